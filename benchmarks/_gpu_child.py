"""Child of gpu_check.py: one load onto one device, timed to a usable model (measure.py's protocol).

    python benchmarks/_gpu_child.py --loader {lowmem,lowmem-map,lowmem-ambient,transformers,safetensors}
        --path DIR --dtype bfloat16 --device cuda|cpu
    python benchmarks/_gpu_child.py --loader copy --device cuda --nbytes N     # the machine's host-to-device copy
    RANK=r LOCAL_RANK=r WORLD_SIZE=n MASTER_ADDR=... MASTER_PORT=... python benchmarks/_gpu_child.py --tp \
        --loader {lowmem,transformers} --path DIR --dtype bfloat16 --device cuda|cpu   # one rank of a TP load

Loaders (the same request each: every weight of DIR as ``--dtype`` on the device):

- ``lowmem``: ``LowMemAutoModelForCausalLM.from_pretrained(DIR, torch_dtype=..., device=DEVICE)``;
- ``lowmem-map``: the same with ``device_map={"": 0}`` (``{"": "cpu"}`` on the CPU);
- ``lowmem-ambient``: the same inside ``with torch.device(DEVICE):`` with neither argument;
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=..., device_map={"": 0})``;
- ``safetensors``: ``safetensors.torch.load_file(f, device=DEVICE)`` per shard, each tensor cast to ``--dtype`` on
  the device (no model: the floor a model load is read against).

The clock stops when the weights are on the device and the device is idle (``torch.cuda.synchronize``). After
LOADED, outside the measured peak, the child hashes every tensor's bytes (name -> blake2b of dtype, shape and
bytes) so that the parent can compare loaders bit for bit. ``--tp``: the rank joins its group (NCCL on CUDA, gloo
on the CPU) before READY and loads with ``tp_plan="auto"`` onto the device transformers binds it to (the
accelerator at ``LOCAL_RANK``); its hashes are of its local shards. ``copy`` times a plain ``tensor.copy_`` from pinned host
memory to the device (from plain memory on the CPU), the best of 5: the bandwidth the loaders are read against.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import sys
import time

from _child import say, wait_for_parent


def digest(tensors) -> dict[str, str]:
    """name -> hash of (dtype, shape, device type, bytes): equal hashes are bit-identical tensors."""
    import torch

    out = {}
    for name, t in tensors:
        t = t.detach()
        h = hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}|{t.device.type}".encode(), digest_size=16)
        host = t.to("cpu").contiguous()
        if host.numel():
            h.update(host.reshape(-1).view(torch.uint8).numpy().data)
        out[name] = h.hexdigest()
    return out


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load(loader: str, path: str, dtype, device, *, tp: bool = False):
    """The request as each loader spells it; returns (name, tensor) pairs of what is now on the device (``tp``:
    this rank's local shards)."""
    import torch

    if tp:
        if loader == "transformers":
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto")
        else:
            from lowmem_hf import LowMemAutoModelForCausalLM

            model = LowMemAutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, tp_plan="auto")
        return [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in model.state_dict(keep_vars=True).items()]
    if loader == "safetensors":
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            weights.update({k: v.to(dtype) for k, v in load_file(f, device=str(device)).items()})
        return list(weights.items())
    one_device = {"": 0} if device.type == "cuda" else {"": "cpu"}
    if loader == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=one_device)
    else:
        from lowmem_hf import LowMemAutoModelForCausalLM as LowMem

        if loader == "lowmem":
            model = LowMem.from_pretrained(path, torch_dtype=dtype, device=str(device))
        elif loader == "lowmem-map":
            model = LowMem.from_pretrained(path, torch_dtype=dtype, device_map=one_device)
        else:
            with torch.device(device):
                model = LowMem.from_pretrained(path, torch_dtype=dtype)
    return list(model.state_dict(keep_vars=True).items())


def copy_bandwidth(device, nbytes: int) -> dict:
    """Bytes per second of the best of 5 plain copies of ``nbytes`` from (pinned) host memory to ``device``."""
    import torch

    pinned = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return {"bytes_per_second": nbytes / best, "nbytes": nbytes, "pinned": pinned}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", required=True,
                    choices=("lowmem", "lowmem-map", "lowmem-ambient", "transformers", "safetensors", "copy"))
    ap.add_argument("--path")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--nbytes", type=int, default=1 << 30)
    ap.add_argument("--no-digest", action="store_true", help="time only; hash nothing")
    ap.add_argument("--tp", action="store_true", help="one rank of a tp_plan='auto' load (RANK, WORLD_SIZE... set)")
    args = ap.parse_args()

    import torch
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf

    device = torch.device(args.device)
    if args.tp and device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # the device transformers binds the rank to
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.set_device(device)
        torch.empty(1, device=device)  # the CUDA context exists before the clock, for every loader
    if args.tp:  # the group exists before the clock, for both loaders
        import torch.distributed as dist

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["WORLD_SIZE"])))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **({"device_id": device} if device.type == "cuda" else {}))
        dist.barrier()
    if args.loader == "copy":
        say("READY")
        wait_for_parent("go")
        result = copy_bandwidth(device, args.nbytes)
        say("LOADED")
        wait_for_parent("go")
        say("RESULT " + json.dumps(result))
        wait_for_parent("exit")
        return 0
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(args.path))]  # modeling_llama imported before the clock
    lowmem_hf.LowMemAutoModelForCausalLM  # noqa: B018  (the lazy package resolves its class before the clock)
    dtype = getattr(torch, args.dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    say("READY")
    wait_for_parent("go")
    t0 = time.perf_counter()
    tensors = load(args.loader, args.path, dtype, device, tp=args.tp)
    synchronize(device)
    seconds = time.perf_counter() - t0
    say("LOADED")
    wait_for_parent("go")
    result = {
        "load_seconds": seconds,
        "model_bytes": sum(t.numel() * t.element_size() for _, t in tensors),
        "device_max_allocated": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "devices": sorted({str(t.device) for _, t in tensors}),
        "digest": None if args.no_digest else digest(tensors),
    }
    say("RESULT " + json.dumps(result))
    wait_for_parent("exit")
    if args.tp:
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
