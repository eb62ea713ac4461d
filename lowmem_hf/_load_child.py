"""A measured load in a fresh process, for ``lowmem-hf load``: one loader, one request, the sampler protocol.

    python -m lowmem_hf._load_child --loader lowmem|transformers MODEL [--auto-class C] [--dtype D] ...

It follows ``lowmem_hf.measure``'s protocol on stdout: READY (imports done, the model's module imported so
neither loader is charged for it), then the timed load, LOADED, then one RESULT JSON line. Under torchrun
every rank's child inherits the launcher's environment and joins the process group itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .measure import PREFIX


def _say(message: str) -> None:
    sys.stdout.write(PREFIX + message + "\n")
    sys.stdout.flush()


def _wait(expected: str) -> None:
    line = sys.stdin.readline().strip()
    if line != expected:
        raise SystemExit(f"expected {expected!r} from the parent, got {line!r}")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--loader", choices=["lowmem", "transformers"], required=True)
    p.add_argument("--auto-class", default="AutoModelForCausalLM")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dtype-policy", default="declared")
    p.add_argument("--revision")
    p.add_argument("--fetch", default="files")
    p.add_argument("--tp-size", type=int, default=1)
    args = p.parse_args(argv)

    import torch
    import transformers

    import lowmem_hf
    import lowmem_hf.load  # noqa: F401 - the package imports its stages on first use: before the baseline, as before
    from lowmem_hf.assign import model_nbytes
    from lowmem_hf.compat.transformers_api import model_class_for

    auto = getattr(transformers, args.auto_class)
    config = transformers.AutoConfig.from_pretrained(args.model, revision=args.revision)
    model_class_for(config, auto)  # imports the model's module before the clock, for both loaders
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    tp = {"tp_plan": "auto"} if args.tp_size > 1 else {}
    _say("READY")
    _wait("go")

    rchar = _rchar()
    start = time.perf_counter()
    if args.loader == "lowmem":
        model, report = getattr(lowmem_hf, "LowMem" + args.auto_class).from_pretrained(
            args.model, torch_dtype=dtype, dtype_policy=args.dtype_policy, revision=args.revision, fetch=args.fetch,
            output_loading_info=True, **tp,
        )
        info = report.to_dict()
    else:
        model, info = auto.from_pretrained(args.model, dtype=dtype, revision=args.revision, output_loading_info=True, **tp)
    seconds = time.perf_counter() - start
    rchar = _rchar() - rchar
    _say("LOADED")
    _wait("go")

    result = {
        "seconds": seconds,
        "rchar": rchar,
        "bytes_read": report.bytes_read if args.loader == "lowmem" else None,
        "model_bytes": model_nbytes(model),
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
    }
    _say("RESULT " + json.dumps(result))
    _wait("exit")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
