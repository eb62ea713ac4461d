"""One rank of bench_resume.py (measure.py protocol): join the gloo group, then resume or save once.

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python benchmarks/_resume_child.py --mode lowmem --path DIR

Modes (the measured step runs between the parent's "go" and our LOADED):
  prep          load the Hub-format checkpoint with TP (fp32), write ``--out``/dcp (dcp.save of the TP state dict),
                ``--out``/sharded (transformers' save_pretrained(distributed_checkpoint=True)) and ``--out``/dcp-whole
                (dcp.save of the whole model by one process); not measured
  lowmem        lowmem_hf from_pretrained(path, bf16, tp_plan="auto")
  dcp           the classic resume: the TP skeleton on meta (bf16), to_empty, dcp.load
  transformers  transformers from_pretrained(path, bf16, tp_plan="auto") (its distributed-checkpoint load)
  save          load bf16 with TP before READY; measured: lowmem_hf.save_pretrained(model, out) (gathered)
  save_sharded  the same, with distributed_checkpoint=True
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _child import say, wait_for_parent


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def local(t):
    return t.data.to_local() if hasattr(t.data, "to_local") else t.data


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["prep", "lowmem", "dcp", "transformers", "save", "save_sharded"])
    parser.add_argument("--path", required=True)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import transformers

    import lowmem_hf

    torch.set_num_threads(1)  # two ranks share two cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained
    bf16 = torch.bfloat16
    # transformers imports the model's module lazily; pay it before the clock for every loader
    transformers.AutoConfig.from_pretrained(args.path)
    transformers.LlamaForCausalLM

    if args.mode == "prep":
        model = load(args.path, torch_dtype=torch.float32, tp_plan="auto")
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(args.out, "dcp"))
        if rank == 0:
            model.config.save_pretrained(os.path.join(args.out, "dcp"))
        model.save_pretrained(os.path.join(args.out, "sharded"), distributed_checkpoint=True)
        del model
        if rank == 0:  # what one process (or a consolidating job) writes: every tensor stored whole
            whole = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32)
            dcp.save(whole.state_dict(), checkpoint_id=os.path.join(args.out, "dcp-whole"), no_dist=True)
            whole.config.save_pretrained(os.path.join(args.out, "dcp-whole"))
            del whole
        dist.barrier()
        say("READY")
        wait_for_parent("go")
        say("LOADED")
        wait_for_parent("go")
        say("RESULT {}")
        wait_for_parent("exit")
        dist.destroy_process_group()
        return 0

    model = None
    if args.mode in ("save", "save_sharded"):
        model = load(args.path, torch_dtype=bf16, tp_plan="auto")
    elif args.mode == "dcp":
        skeleton = lowmem_hf.prepare(lowmem_hf.make_request(transformers.AutoModelForCausalLM, args.path, torch_dtype=bf16, tp_plan="auto")).model
    torch.ones(8).sum()
    dist.barrier()
    say("READY")
    wait_for_parent("go")

    before, start = rchar(), time.perf_counter()
    if args.mode == "lowmem":
        model = load(args.path, torch_dtype=bf16, tp_plan="auto")
    elif args.mode == "transformers":
        model = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=bf16, tp_plan="auto")
    elif args.mode == "dcp":
        model = skeleton.to_empty(device="cpu")
        dcp.load(model.state_dict(), checkpoint_id=args.path)
    else:
        lowmem_hf.save_pretrained(model, args.out, distributed_checkpoint=args.mode == "save_sharded")
    seconds, read = time.perf_counter() - start, rchar() - before
    say("LOADED")
    wait_for_parent("go")

    local_bytes = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    local_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    largest_full = max(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "seconds": seconds,
        "local_bytes": local_bytes,
        "largest_full_bytes": largest_full,
        "rchar": read,
        "stored_local_bytes": sum(local(p).numel() * 4 for p in model.parameters()),  # at the checkpoint's fp32
        "meta": sum(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers())),
    }
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
