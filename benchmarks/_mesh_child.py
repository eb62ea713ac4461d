"""One rank of bench_mesh.py: join the gloo group, then load its shards once under a DistributedConfig (measure.py protocol).

    RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python benchmarks/_mesh_child.py --loader lowmem --path DIR --fsdp-size 2
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
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--fsdp-size", type=int, default=1)
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--warmup", help="a tiny checkpoint to load once before the baseline (see bench_mesh.py)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf

    torch.set_num_threads(1)  # the ranks share two cores
    dist.init_process_group("gloo")
    dtype = getattr(torch, args.dtype)
    # transformers imports the model's module and its distributed helpers lazily: pay that before the clock
    MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(args.path))]
    import torch.distributed._composable.fsdp  # noqa: F401
    torch.ones(8).sum()
    config = DistributedConfig(tp_size=args.tp_size, fsdp_size=args.fsdp_size, dp_replicate_size=args.dp_replicate_size)

    def load(path):
        if args.loader == "lowmem":
            return lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
                path, torch_dtype=dtype, distributed_config=config, output_loading_info=True
            )
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=config), None

    if args.warmup:
        # One tiny load with the same loader and mesh first: the code pages and allocator arenas a process
        # touches the first time it runs DTensor/FSDP2 code are a once-per-process cost, not the model's.
        import gc

        warm = load(args.warmup)
        del warm
        gc.collect()
    dist.barrier()
    say("READY")
    wait_for_parent("go")

    before, start = rchar(), time.perf_counter()
    model, report = load(args.path)
    seconds, read = time.perf_counter() - start, rchar() - before
    say("LOADED")
    wait_for_parent("go")

    def local(t):
        return t.data.to_local() if hasattr(t.data, "to_local") else t.data

    seen, local_bytes = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        lt = local(t)
        if lt.untyped_storage().data_ptr() in seen:
            continue
        seen.add(lt.untyped_storage().data_ptr())
        local_bytes += lt.numel() * lt.element_size()
    stored = sum(local(p).numel() * 4 for p in model.parameters())  # at the checkpoint's dtype (fp32)
    result = {
        "load_seconds": seconds,
        "model_bytes": local_bytes,
        "rchar": read,
        "stored_local_bytes": stored,
        "header_bytes": report.header_bytes if report else None,
        "meta": sum(p.device.type == "meta" for p in model.parameters()),
    }
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
