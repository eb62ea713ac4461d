"""Child of bench_scale.py: one load (a TP rank under RANK/WORLD_SIZE), with the I/O it cost (measure.py's protocol).

    python benchmarks/_cgroup_child.py --loader {lowmem,transformers} --path DIR --dtype bfloat16

After LOADED it reports the load's time, the model's bytes, and the deltas of its major page faults
(``getrusage``) and of ``/proc/self/io`` (``read_bytes``: what storage delivered; ``rchar``: what read calls
returned) from just before the clock. The parent has put this process in a memory cgroup before it imported
anything; a load the cgroup kills never reports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from _child import say, wait_for_parent


def io_counters() -> dict[str, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(":") for line in f)
    return {"read_bytes": int(fields["read_bytes"]), "rchar": int(fields["rchar"]),
            "majflt": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", choices=("lowmem", "transformers"), required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    dtype = getattr(torch, args.dtype)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(args.path))]
    LowMem = lowmem_hf.LowMemAutoModelForCausalLM
    tp = {"tp_plan": "auto"} if distributed else {}
    say("READY")
    wait_for_parent("go")
    before = io_counters()
    t0 = time.perf_counter()
    if args.loader == "lowmem":
        model = LowMem.from_pretrained(args.path, torch_dtype=dtype, **tp)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.path, dtype=dtype, **tp)
    seconds = time.perf_counter() - t0
    after = io_counters()
    say("LOADED")
    wait_for_parent("go")

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    model_bytes = sum(local(p.data).numel() * p.element_size() for p in model.parameters())
    result = {"load_seconds": seconds, "model_bytes": model_bytes, **{k: after[k] - before[k] for k in after}}
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
