"""The Hub layout, gathered point to point: each safetensors header is computed from shapes up front, then for every
tensor each rank converts its local shard and sends it to rank 0, which ``pwrite``s the shards one at a time at
their places in the row-major layout. Rank 0 holds its local shard plus one received shard of one tensor; the other
ranks hold nothing beyond their shards. No rank ever builds a full state dict, nor even one full tensor."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..formats.safetensors import encode_header
from ..runs import box_runs
from .agree import agree, os_failure
from .commit import SAFE_WEIGHTS_INDEX_NAME, Staging, pwrite_all, switch_gathered
from .entries import Entry, as_shard, write_configs

__all__ = ["save_gathered"]


def _pieces(entry: Entry, world: int) -> list[tuple[int, int, int]] | None:
    """For a ``Shard(d)`` DTensor: every rank's ``(dim, offset, size)`` along ``d`` (torch.chunk's split), else None."""
    placement = entry.tensor.placements[0] if isinstance(entry.tensor, DTensor) else None
    if not isinstance(placement, Shard):
        return None
    n = entry.shape[placement.dim]
    return [(placement.dim, *reversed(Shard.local_shard_size_and_offset(n, world, r))) for r in range(world)]


def _write_gathered(fd: int | None, start: int, entry: Entry, group, rank: int) -> None:
    """Write one tensor at byte ``start`` of rank 0's file (``fd``; ``None`` on other ranks or after a failure).

    A ``Shard(d)`` tensor is never gathered whole: every rank converts its local shard, rank 0 receives them
    one at a time and ``pwrite``s each at its place in the row-major layout (one run per leading index for
    ``d > 0``). Rank 0 holds at most its own shard plus one received shard of this tensor.
    """
    t = entry.tensor.detach()
    if not isinstance(t, DTensor):
        if rank == 0:
            _pwrite_runs(fd, start, t.to(entry.dtype).contiguous(), [(0, 0, t.numel())], entry)
        return
    t = as_shard(t)
    local = t.to_local().to(entry.dtype).contiguous()
    world = t.device_mesh.size()
    pieces = _pieces(Entry(entry.name, t, entry.dtype), world)
    if pieces is None:  # replicated: rank 0's copy is the tensor
        if rank == 0:
            _pwrite_runs(fd, start, local, [(0, 0, local.numel())], entry)
        return
    if rank != 0:
        if local.numel():
            dist.send(local.reshape(-1).view(torch.uint8), group=group, group_dst=0)
        return
    failed = None
    for r, (dim, offset, size) in enumerate(pieces):
        if size == 0:
            continue
        shape = list(entry.shape)
        shape[dim] = size
        if r == 0:
            piece = local
        else:
            piece = torch.empty(shape, dtype=entry.dtype)
            dist.recv(piece.reshape(-1).view(torch.uint8), group=group, group_src=r)
        at = [0] * len(shape)
        at[dim] = offset
        runs = box_runs(tuple(shape), (0,) * len(shape), entry.shape, tuple(at), tuple(shape))
        try:
            _pwrite_runs(None if failed else fd, start, piece, runs, entry)
        except OSError as e:  # receive the other ranks' pieces all the same: they are already sending
            failed = e
        del piece
    if failed is not None:
        raise failed


def _pwrite_runs(fd: int | None, start: int, values: torch.Tensor, runs: list[tuple[int, int, int]], entry: Entry) -> None:
    """``pwrite`` ``(src, dst, n)`` element runs of ``values`` to ``start + dst * itemsize``."""
    if fd is None or values.numel() == 0:
        return
    data = memoryview(values.reshape(-1).view(torch.uint8).numpy())
    size = entry.dtype.itemsize
    for src, dst, n in runs:
        pwrite_all(fd, data[src * size : (src + n) * size], start + dst * size)


def _write_file(staging: Staging, filename: str, header: bytes, entries: list[Entry], group, rank: int) -> None:
    """One safetensors file of the Hub layout: rank 0 writes the header, then every rank takes part in every
    tensor's exchange, even after a local failure, so that none hangs."""
    size = len(header) + sum(e.nbytes for e in entries)
    fd = staging.create(filename, size) if rank == 0 else None
    try:
        if fd is not None:
            pwrite_all(fd, memoryview(header), 0)
    except OSError as e:
        staging.fail(filename, e, size)
    start = len(header)
    for entry in entries:
        try:
            _write_gathered(fd if staging.failure is None else None, start, entry, group, rank)
        except OSError as e:
            staging.fail(filename, e, size)
        start += entry.nbytes
    staging.close(fd, filename, size)


def save_gathered(model: Any, directory: str, entries: list[Entry], group, rank: int, max_shard_size, staging: Staging) -> None:
    """Every rank: write the Hub layout (``model.safetensors``, or shards and their index, split as transformers
    splits them), rank 0 alone holding the files; then, once every rank agreed, switch to it."""
    from huggingface_hub import split_torch_state_dict_into_shards

    by_name = {e.name: e for e in entries}
    meta = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    headers = {
        filename: encode_header([(n, by_name[n].dtype, by_name[n].shape) for n in names], {"format": "pt"})
        for filename, names in split.filename_to_tensors.items()
    }
    staging.weight_bytes = sum(len(h) for h in headers.values()) + sum(e.nbytes for e in entries)  # exact: headers too
    for filename, names in split.filename_to_tensors.items():
        _write_file(staging, filename, headers[filename], [by_name[n] for n in names], group, rank)
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata}, "weight_map": split.tensor_to_filename}
    if rank == 0:
        if index is not None:
            staging.write_file(SAFE_WEIGHTS_INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        write_configs(staging, model, entries)
    unchanged = f"nothing in {directory} changed (the new files were written aside and are removed)"
    agree(staging.failure, group, what="write the checkpoint", outcome=unchanged, cause=staging.cause)
    failure = None
    if rank == 0:
        try:
            switch_gathered(staging, index)
        except OSError as e:
            failure = os_failure(e.errno, f"moving the new files into {directory}: {e}")
    agree(failure, group, what="switch to the new checkpoint", outcome="the folder loads the old or the new checkpoint")
