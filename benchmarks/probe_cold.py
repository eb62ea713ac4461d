"""How a cold load's reads should be issued: lowmem_hf's reader threads, chunk size and read-ahead hints, against
transformers, each load from a dropped page cache.

    python benchmarks/probe_cold.py DIR [--variants transformers lowmem w4 w16 c4m c16m nohints] [--repeats 3]

Every load runs in a fresh child that imports everything (the model's module included) and then waits; the page
cache is dropped (root) and the child loads ``DIR`` as bf16. The variants run in turn within each repeat, the
order reversed every other repeat. A variant changes one of lowmem_hf's cold-read settings in the child:

    lowmem     the defaults (``stream.COLD_WORKERS`` threads, ``stream.COLD_CHUNK_BYTES`` per read as capped, hints)
    wN         N reader threads
    cNm        chunks of N MiB, as capped (``chunk_bytes=``; staging, where the dtype changes, is threads x chunk)
    nohints    no announcements to the kernel (``posix_fadvise(WILLNEED)``) of the reads entering the window
    a+b        both settings (``c16m+nohints``)

Printed per variant: the median return time and its ratio to transformers, and the disk's rate over the load
(``/proc/self/io`` read_bytes per second). A probe, not a benchmark: it says which setting gives the disk more;
``bench_shapes.py --cache cold`` and ``bench_scale.py --drop-caches`` are the measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoints import drop_page_cache  # noqa: E402


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def child(path: str, variant: str) -> None:
    import time

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf
    import lowmem_hf.load as load_stage
    import lowmem_hf.stream as stream_stage

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))]
    LowMem = lowmem_hf.LowMemAutoModelForCausalLM
    kwargs = {}
    for setting in variant.split("+"):
        if setting.startswith("w"):
            workers = int(setting[1:])
            load_stage.choose_workers = lambda cached, n=workers: n if cached is not None and cached < 0.9 else stream_stage.DEFAULT_WORKERS
        elif setting.startswith("c") and setting.endswith("m"):
            kwargs["chunk_bytes"] = int(setting[1:-1]) << 20
        elif setting == "nohints":
            original = load_stage.stream

            def without_hints(*a, original=original, **kw):
                kw["read_ahead_hints"] = False
                return original(*a, **kw)

            load_stage.stream = without_hints
        elif setting not in ("lowmem", "transformers"):
            raise SystemExit(f"unknown setting {setting!r} in variant {variant!r}")
    print("READY", flush=True)
    sys.stdin.readline()
    before, t0 = read_bytes(), time.perf_counter()
    if variant == "transformers":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    else:
        model = LowMem.from_pretrained(path, torch_dtype=torch.bfloat16, **kwargs)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "read_bytes": read_bytes() - before, "params": sum(p.numel() for p in model.parameters())}), flush=True)


def run_one(path: str, variant: str) -> dict:
    env = dict(os.environ, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")  # no progress bars in the output
    proc = subprocess.Popen([sys.executable, __file__, "--child", variant, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "READY"
    if not drop_page_cache():
        proc.kill()
        raise SystemExit("cannot drop the page cache here (needs root)")
    proc.stdin.write("go\n")
    proc.stdin.flush()
    result = json.loads(proc.stdout.readline())
    proc.wait()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--variants", nargs="+", default=["transformers", "lowmem", "w4", "w16", "c4m", "c16m", "nohints"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.path, args.child)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for repeat in range(args.repeats):
        for variant in args.variants if repeat % 2 == 0 else args.variants[::-1]:
            result = run_one(args.path, variant)
            runs[variant].append(result)
            print(f"[cold] repeat {repeat + 1} {variant:>12}: {result['seconds']:.2f} s, "
                  f"{result['read_bytes'] / result['seconds'] / 1e9:.2f} GB/s from disk", flush=True)
    reference = statistics.median(r["seconds"] for r in runs["transformers"]) if "transformers" in runs else None
    for variant, results in runs.items():
        median = statistics.median(r["seconds"] for r in results)
        rate = statistics.median(r["read_bytes"] / r["seconds"] for r in results) / 1e9
        ratio = f", {median / reference:.2f}x transformers" if reference else ""
        print(f"[cold] {variant:>12}: median {median:.2f} s{ratio}, disk {rate:.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
