"""One rank of bench_tp.py: join the gloo group, then load its tensor-parallel shard once (measure.py protocol).

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python benchmarks/_tp_child.py --loader lowmem --path DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from _child import say, wait_for_parent


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["lowmem", "transformers"], required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers

    import lowmem_hf

    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo")
    dtype = getattr(torch, args.dtype)
    torch.ones(8).sum()
    say("READY")
    wait_for_parent("go")

    before, start = rchar(), time.perf_counter()
    if args.loader == "lowmem":
        model, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
            args.path, torch_dtype=dtype, tp_plan="auto", output_loading_info=True
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype, tp_plan="auto")
        report = None
    seconds, read = time.perf_counter() - start, rchar() - before
    say("LOADED")
    wait_for_parent("go")

    def local(t):
        return t.data.to_local() if hasattr(t.data, "to_local") else t.data

    local_bytes = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    local_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    stored = sum(  # what this rank's parameters occupy at the checkpoint's dtype (fp32 here)
        local(p).numel() * 4 for n, p in model.named_parameters()
    )
    result = {
        "load_seconds": seconds,
        "model_bytes": local_bytes,
        "rchar": read,
        "stored_local_bytes": stored,
        "report_bytes_read": report.bytes_read if report else None,
        "header_bytes": report.header_bytes if report else None,
        "meta": sum(p.device.type == "meta" for p in model.parameters()),
    }
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
