"""``distributed_checkpoint=True``: each rank writes its local shards with no gather, in transformers' sharded format
(``shard-<rank+1>-model-00001-of-00001.safetensors`` with DCP's ``DCP_SHARDING_INFO`` offsets, what DCP's
``HuggingFaceStorageWriter`` writes), tied tensors once; ``from_pretrained`` of lowmem_hf reads it back at any
tp_size. Written by hand rather than through ``dcp.save`` because DCP's writer serializes each rank's whole file in
memory (``safetensors.torch.save``) and refuses tied tensors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ..compat.torch_api import hf_rank_shard
from ..distributed import local_intervals
from ..formats.safetensors import encode_header
from .agree import agree
from .commit import Staging, pwrite_all, switch_rank_files
from .entries import Entry, as_shard, write_configs

__all__ = ["save_sharded"]


def _local_part(entry: Entry, rank: int) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """This rank's stored chunk of a tensor and its global offsets, or ``None`` if another rank stores it.

    Replicated tensors (and plain ones in a TP model) are stored once, by rank 0. ``_StridedShard`` is
    redistributed to the equivalent ``Shard`` first (as transformers does), so every chunk is one box.
    """
    t = entry.tensor.detach()
    ndim = len(entry.shape)
    if not isinstance(t, DTensor):
        return (t if rank == 0 else None), (0,) * ndim
    t = as_shard(t)
    if isinstance(t.placements[0], Replicate):
        return (t.to_local() if t.device_mesh.get_local_rank() == 0 else None), (0,) * ndim
    intervals = local_intervals(tuple(t.shape), t.placements, tuple(t.device_mesh.shape), t.device_mesh.get_coordinate())
    return t.to_local(), tuple(runs[0][0] if runs else 0 for runs in intervals)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview((t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)).numpy())


def _write_rank_file(staging: Staging, rank: int, parts: list[tuple[Entry, torch.Tensor, tuple[int, ...]]]) -> None:
    """This rank's one file: the header with every part's global offsets, then the parts' bytes in order."""
    name, metadata = hf_rank_shard(rank, {e.name: list(off) for e, _, off in parts})
    header = encode_header([(e.name, e.dtype, tuple(local.shape)) for e, local, _ in parts], metadata)
    size = len(header) + sum(e.dtype.itemsize * local.numel() for e, local, _ in parts)
    fd = staging.create(name, size)
    if fd is None:
        return
    try:
        pwrite_all(fd, memoryview(header), 0)
        offset = len(header)
        for e, local, _ in parts:
            data = _tensor_bytes(local.to(e.dtype))
            pwrite_all(fd, data, offset)
            offset += len(data)
    except OSError as e:
        staging.fail(name, e, size)
    staging.close(fd, name, size)


def save_sharded(model: Any, directory: str, entries: list[Entry], group, rank: int, staging: Staging) -> None:
    """Every rank: write its own rank file (rank 0 the configs too); then, once every rank agreed, switch to them."""
    parts = []
    for entry in entries:
        local, offsets = _local_part(entry, rank)
        if local is not None:
            parts.append((entry, local, offsets))
    if parts:
        _write_rank_file(staging, rank, parts)
    if rank == 0:
        write_configs(staging, model, entries)
    written = [staging.names]
    if group is not None:
        written = [None] * dist.get_world_size(group)
        dist.all_gather_object(written, staging.names, group=group)
    unchanged = f"nothing in {directory} changed (the new files were written aside and are removed)"
    agree(staging.failure, group, what="write the checkpoint", outcome=unchanged, cause=staging.cause)
    switch_rank_files(staging, group, rank, keep={n for names in written for n in names})
