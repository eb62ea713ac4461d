"""One rank of bench_zero3.py: join the gloo group through DeepSpeed, then load the model once under ZeRO-3
(measure.py protocol).

    DS_ACCELERATOR=cpu RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... \
        python benchmarks/_zero3_child.py --loader {lowmem,transformers,build} --path DIR [--warmup TINY_DIR] [--no-init-broadcast]

``build`` only constructs the model under transformers' ZeRO-3 init context (what both loaders do before reading);
``--no-init-broadcast`` is an experiment that patches DeepSpeed's ``Init._zero_init_param`` in this process to
partition each new parameter without first broadcasting rank 0's (uninitialized) values.

Before READY (part of the baseline): imports, ``deepspeed.init_distributed(dist_backend="gloo")``, the
``HfDeepSpeedConfig`` of stage 3 with bf16 (kept alive: transformers holds it by a weak reference), the model class
resolved (transformers imports ``modeling_llama`` lazily; neither loader is charged for it) and, with ``--warmup``,
one load of a tiny Llama with the same loader and config (the code pages and allocator arenas a process touches the
first time it runs ``zero.Init`` and the gather/partition code are a once-per-process cost, not the model's).
After LOADED (not measured): partition bytes, dtypes, and the values checked against the checkpoint's fingerprint
(exact sampled elements inside this rank's range, and per-tensor sums over all ranks' partitions).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from _child import say, wait_for_parent


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loader", choices=["lowmem", "transformers", "build"], required=True,
                        help="build: only construct the model under transformers' ZeRO-3 init context (zero.Init), read nothing")
    parser.add_argument("--path", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warmup", help="a tiny checkpoint to load once before the baseline")
    parser.add_argument("--profile", help="write a cProfile of the measured load to this file")
    parser.add_argument("--no-init-broadcast", action="store_true",
                        help="experiment: zero.Init partitions each new parameter without first broadcasting rank 0's "
                             "(uninitialized) values to every rank")
    args = parser.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    import transformers
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf

    torch.set_num_threads(1)  # the ranks share two cores
    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ds_config = {
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": world,
    }
    keep_alive = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds it by a weak reference
    dtype = getattr(torch, args.dtype)
    if args.no_init_broadcast:
        from deepspeed.runtime.zero.partition_parameters import Init

        def _zero_init_param(self, param):  # DeepSpeed 0.19.8's, less the broadcast before partition()
            self._convert_to_deepspeed_param(param)
            param.partition()

        Init._zero_init_param = _zero_init_param
    # transformers imports the model's module lazily: pay that before the clock, for both loaders
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(transformers.AutoConfig.from_pretrained(args.path))]
    torch.ones(8).sum()

    def load(path):
        if args.loader == "build":  # the skeleton both loaders build first, exactly as from_pretrained builds it
            from contextlib import ExitStack

            config = transformers.AutoConfig.from_pretrained(path)
            with ExitStack() as stack:
                for context in model_class.get_init_context(dtype, False, False, None):
                    stack.enter_context(context)
                return model_class(config), None
        if args.loader == "lowmem":
            return lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, output_loading_info=True)
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype), None

    if args.warmup:
        import gc

        warm = load(args.warmup)
        del warm
        gc.collect()
    dist.barrier()
    say("READY")
    wait_for_parent("go")

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    before, start = rchar(), time.perf_counter()
    model, report = load(args.path)
    seconds, read = time.perf_counter() - start, rchar() - before
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    say("LOADED")
    wait_for_parent("go")

    from checkpoints import FINGERPRINT

    params = dict(model.named_parameters())  # unique parameters (a tied one once)
    partitioned = all(hasattr(p, "ds_tensor") and tuple(p.shape) == (0,) for p in params.values())
    partition_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in params.values())
    partition_elements = 0  # valid elements (the last rank's padding excluded)
    sums = torch.zeros(2 * len(params), dtype=torch.float64)
    samples_checked, samples_wrong = 0, []
    expected = json.loads((Path(args.path) / FINGERPRINT).read_text())[args.dtype]
    dtypes = set()
    for i, (name, p) in enumerate(params.items()):
        size = p.ds_tensor.numel()
        start_el = min(rank * size, p.ds_numel)
        valid = p.ds_tensor.view(-1)[: min(size, p.ds_numel - start_el)]
        partition_elements += valid.numel()
        dtypes.add(str(valid.dtype))
        d = valid.to(torch.float64)
        sums[2 * i], sums[2 * i + 1] = d.sum(), (d * d).sum()
        if args.loader == "build":
            continue
        fp = expected[name]
        for idx, want in zip(fp["idx"], fp["samples"]):
            if start_el <= idx < start_el + valid.numel():
                samples_checked += 1
                if valid[idx - start_el].item() != want:
                    samples_wrong.append(name)
                    break
    dist.all_reduce(sums)
    import math

    sums_wrong = []
    for i, name in enumerate(params if args.loader != "build" else ()):
        fp = expected[name]
        scale = math.sqrt(max(fp["sumsq"], 0.0)) + 1e-30
        if not (math.isclose(sums[2 * i].item(), fp["sum"], rel_tol=1e-9, abs_tol=1e-9 * scale)
                and math.isclose(sums[2 * i + 1].item(), fp["sumsq"], rel_tol=1e-9)):
            sums_wrong.append(name)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    result = {
        "load_seconds": seconds,
        "rchar": read,
        "partition_bytes": partition_bytes,
        "partition_elements": partition_elements,
        "stored_partition_bytes": 4 * partition_elements,  # at the checkpoint's dtype (fp32)
        "buffer_bytes": buffer_bytes,
        "partition_dtypes": sorted(dtypes),
        "partitioned": partitioned,
        "samples_checked": samples_checked,
        "values_ok": None if args.loader == "build" else not samples_wrong and not sums_wrong,
        "wrong": (samples_wrong + sums_wrong)[:10],
        "report_bytes_read": report.bytes_read if report else None,
        "header_bytes": report.header_bytes if report else None,
        "reader_workers": report.reader_workers if report else None,
    }
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
