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
    from transformers import LlamaConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf

    torch.set_num_threads(1)
    if args.tp:
        dist.init_process_group("gloo")
    # before the clock, for both loaders (as _usable_child.py): the model's module (every bench_hub shape is a
    # Llama) and each loader's entry class, whose first access imports its stages (transformers' lazy module too)
    MODEL_FOR_CAUSAL_LM_MAPPING[LlamaConfig]
    Auto, LowMem = transformers.AutoModelForCausalLM, lowmem_hf.LowMemAutoModelForCausalLM
    tp = {"tp_plan": "auto"} if args.tp else {}
    start = time.perf_counter()
    counts = {}
    if args.loader == "lowmem":
        model, report = LowMem.from_pretrained(
            args.repo, torch_dtype=torch.bfloat16, fetch=args.fetch, output_loading_info=True, **tp
        )
        counts = {"bytes_received": report.bytes_received, "bytes_read": report.bytes_read}
    else:
        model = Auto.from_pretrained(args.repo, dtype=torch.bfloat16, **tp)
    seconds = time.perf_counter() - start
    assert not any(p.device.type == "meta" for p in model.parameters())
    print("@@RESULT " + json.dumps({"seconds": seconds, "rank": dist.get_rank() if args.tp else 0, **counts}), flush=True)
    if args.tp:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
