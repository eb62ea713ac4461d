"""Child of bench_scale_plan.py (measure.py's protocol): plan every rank of a mesh, or load one rank's share.

    python benchmarks/_scale_child.py --mode plan --path DIR --tp-size 8 [--fsdp-size 8]
    python benchmarks/_scale_child.py --mode {load,bare} --path DIR --tp-size 8 [--fsdp-size 8] --rank R

``plan``: ``prepare(...).estimate()`` for every rank of the mesh in this one process, no group (``MeshRank``),
as ``lowmem-hf plan`` runs it. ``load``: ``from_pretrained(DIR, torch_dtype=bf16, device_mesh=MeshRank(...))``.
``bare``: the same rank's planned reads and nothing else: its plan (made before the clock) gives every
destination's local shape and the file runs that fill it; the clock covers allocating each destination and
``preadv`` of its runs, no model, no conversion, no threads (the floor the load is read against).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from _child import say, wait_for_parent


def _request(path: str, mesh):
    import torch
    from transformers import AutoModelForCausalLM

    from lowmem_hf.request import make_request

    return make_request(AutoModelForCausalLM, path, torch_dtype=torch.bfloat16, device_mesh=mesh)


def plan_all(path: str, sizes: dict) -> dict:
    from lowmem_hf.distributed.mesh_rank import MeshRank
    from lowmem_hf.load import prepare

    world = MeshRank(rank=0, **sizes).world_size
    per_rank, estimates = [], []
    for rank in range(world):
        t0 = time.perf_counter()
        estimates.append(prepare(_request(path, MeshRank(rank=rank, **sizes))).estimate())
        per_rank.append(time.perf_counter() - t0)
    return {"ranks": world, "per_rank_seconds": per_rank, "bytes_to_read": [e.bytes_to_read for e in estimates],
            "final_bytes": [e.final_bytes for e in estimates], "tensors": len(estimates[0].dtype_summary)}


def bare_reads(prepared) -> int:
    """Every planned read of ``prepared`` into a fresh destination of its local shape with ``preadv``; bytes read."""
    import torch

    from lowmem_hf.runs import interval_runs

    fds, total, keep = {}, 0, []
    for read in prepared.plan.reads:
        info, shard = read.source, read.shard
        dst = torch.empty(read.local_shape, dtype=read.decision.dtype)
        view = memoryview(dst.view(torch.uint8).reshape(-1).numpy()) if dst.numel() else memoryview(bytearray())
        size = info.dtype.itemsize
        if shard is None:
            runs = [(0, info.numel)]
        elif shard.intervals is not None:
            runs = interval_runs(info.shape, shard.intervals)
        else:
            inner = 1
            for n in info.shape[shard.dim + 1:]:
                inner *= n
            outer = 1
            for n in info.shape[: shard.dim]:
                outer *= n
            step = info.shape[shard.dim] * inner
            runs = [(o * step + shard.start * inner, o * step + shard.stop * inner) for o in range(outer)]
        if info.file not in fds:
            fds[info.file] = os.open(info.file, os.O_RDONLY)
        fd = fds[info.file]
        at = 0
        for a, b in runs:
            n = (b - a) * size
            total += os.preadv(fd, [view[at : at + n]], info.offset + a * size)
            at += n
        keep.append(dst)
    for fd in fds.values():
        os.close(fd)
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("plan", "load", "bare"), required=True)
    ap.add_argument("--path", required=True)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--fsdp-size", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()

    import torch  # noqa: F401
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf
    from lowmem_hf.distributed.mesh_rank import MeshRank
    from lowmem_hf.load import prepare

    sizes = {"tp_size": args.tp_size, "fsdp_size": args.fsdp_size}
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(args.path))]
    LowMem = lowmem_hf.LowMemAutoModelForCausalLM
    mesh = MeshRank(rank=args.rank, **sizes)
    prepared = prepare(_request(args.path, mesh)) if args.mode == "bare" else None
    say("READY")
    wait_for_parent("go")
    t0 = time.perf_counter()
    if args.mode == "plan":
        result = plan_all(args.path, sizes)
    elif args.mode == "bare":
        result = {"bytes_read": bare_reads(prepared)}
    else:
        model = LowMem.from_pretrained(args.path, torch_dtype=torch.bfloat16, device_mesh=mesh)
        report = model.lowmem_report
        result = {"bytes_read": report.bytes_read, "model_bytes": report.model_bytes}
    result["seconds"] = time.perf_counter() - t0
    say("LOADED")
    wait_for_parent("go")
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
