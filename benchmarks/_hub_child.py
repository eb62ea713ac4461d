"""One process of bench_hub.py: load org/bench from the loopback Hub (HF_ENDPOINT in the env) and print timings.

    python benchmarks/_hub_child.py --loader {lowmem,transformers} [--fetch files|ranges] [--tp]
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["lowmem", "transformers"], required=True)
    parser.add_argument("--fetch", default="files")
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--repo", default="org/bench")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers

    import lowmem_hf

    torch.set_num_threads(1)
    if args.tp:
        dist.init_process_group("gloo")
    tp = {"tp_plan": "auto"} if args.tp else {}
    start = time.perf_counter()
    counts = {}
    if args.loader == "lowmem":
        model, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
            args.repo, torch_dtype=torch.bfloat16, fetch=args.fetch, output_loading_info=True, **tp
        )
        counts = {"bytes_received": report.bytes_received, "bytes_read": report.bytes_read}
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.repo, dtype=torch.bfloat16, **tp)
    seconds = time.perf_counter() - start
    assert not any(p.device.type == "meta" for p in model.parameters())
    print("@@RESULT " + json.dumps({"seconds": seconds, "rank": dist.get_rank() if args.tp else 0, **counts}), flush=True)
    if args.tp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
