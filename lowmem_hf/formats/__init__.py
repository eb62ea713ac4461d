"""Checkpoint formats: one module per format (``dcp/``: a small package), and nothing outside them knows a
format's internals.

Each module holds what its format alone knows: parsing and checking its header or metadata into ``TensorInfo``s,
and a ``Reader`` (``base.py``) whose jobs fill a destination (the whole tensor, a slice, dim-1 runs) from a byte
source (``sources/``). Each offers the same two functions, chosen by checkpoint format in ``FORMATS``:

- ``open_reader(checkpoint, plan, source, *, chunk_bytes, weights_only, mmap, stats) -> Reader``;
- ``staging_bytes(plan, checkpoint, *, workers, per_worker, converted) -> int``: the host memory its reader holds
  beyond the destinations (the dry run's prediction).
"""

from __future__ import annotations

from ..sources import ByteSource
from ..types import Checkpoint, CheckpointFormat, LoadPlan
from . import dcp, safetensors, torch_pickle
from .base import Reader, StreamStats

__all__ = ["FORMATS", "open_reader", "Reader", "StreamStats"]

FORMATS = {
    CheckpointFormat.SAFETENSORS: safetensors,
    CheckpointFormat.TORCH_ZIP: torch_pickle,
    CheckpointFormat.TORCH_LEGACY: torch_pickle,
    CheckpointFormat.DCP: dcp,
}


def open_reader(
    checkpoint: Checkpoint, plan: LoadPlan, source: ByteSource, *, chunk_bytes: int, weights_only: bool, mmap: bool, stats: StreamStats
) -> Reader:
    """The reader of ``checkpoint``'s format over ``source``, for the tensors ``plan`` reads."""
    return FORMATS[checkpoint.format].open_reader(
        checkpoint, plan, source, chunk_bytes=chunk_bytes, weights_only=weights_only, mmap=mmap, stats=stats
    )
