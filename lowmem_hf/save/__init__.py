"""Save: a plain or tensor-parallel model back to the Hub layout one tensor at a time, or as rank-local shards.

``save_pretrained(model, dir)`` writes what transformers' ``save_pretrained`` writes (``model.safetensors`` or
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``, the config, the generation config;
tied weights once; the same shard split, by huggingface_hub's ``split_torch_state_dict_into_shards``), but
never builds a full state dict, nor even one full tensor. ``distributed_checkpoint=True`` writes each rank's local
shards with no gather, in transformers' sharded format, which lowmem_hf reads back at any tp_size.

The package, in the order a save runs:

- ``entries``: what to write (the tensors, tied ones once, in the dtype asked; the process group; the configs);
- ``gathered``: the Hub layout, each tensor's shards sent to rank 0, which ``pwrite``s them at their places;
- ``rank_local``: ``distributed_checkpoint=True``, each rank's own shards in a file of its own;
- ``commit``: every new file written aside, switched into place once every rank agreed, the old files removed;
  a checkpoint already in the folder stays loadable until then;
- ``agree``: every rank learns whether any rank failed, and all raise the same error.

The safetensors header is encoded by ``formats/safetensors.py``, beside its parser.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..plan.dtypes import check_float_dtype, parse_dtype
from .agree import agree
from .commit import Staging, prepare_directory
from .entries import entries_of, group_of, refuse_local_slices
from .gathered import save_gathered
from .rank_local import save_sharded

__all__ = ["save_pretrained"]


def save_pretrained(
    model: Any,
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    distributed_checkpoint: bool = False,
) -> None:
    """Write ``model`` to ``save_directory`` one tensor at a time. Under tensor parallelism every rank must call it.

    A checkpoint already in ``save_directory`` stays loadable until the new one is complete (see
    ``lowmem_hf.save.commit``); then it is replaced whole, none of its shards left behind.

    Args:
        model: a transformers ``PreTrainedModel``, plain or with DTensor parameters (``tp_plan`` loads).
        save_directory: created if needed.
        max_shard_size: as in transformers (``"5GB"``, or bytes).
        dtype: write floating tensors in this dtype (``torch.bfloat16`` or ``"bfloat16"``; float16, bfloat16,
            float32 or float64); ``None`` keeps each one's.
        distributed_checkpoint: write each rank's local shards (no gather), transformers' sharded format.

    Raises:
        OSError: ``save_directory`` cannot be written (raised on every rank before anything is written), or a
            rank failed while writing: every rank raises, naming the rank and the file, with ``errno`` set
            (``ENOSPC`` for a full disk, with the bytes the file and the checkpoint need); the files written aside
            are removed and the folder holds what it held before.
        ValueError: a model loaded with ``tp_rank``/``tp_size`` and no process group (its parameters are slices,
            which cannot be saved as full tensors), a placement that cannot be saved, or a ``dtype`` that is not a
            floating dtype transformers loads.
        NotImplementedError: a 2-D (or larger) device mesh, or load-time key conversions that change names.

    Example:
        >>> lowmem_hf.save_pretrained(model, "out", dtype=torch.bfloat16)   # all TP ranks call it
    """
    directory = os.path.abspath(os.fspath(save_directory))
    out_dtype = check_float_dtype(parse_dtype(dtype, argument="dtype"), argument="dtype") if dtype is not None else None
    group = group_of(model)
    rank = dist.get_rank(group) if group is not None else 0
    if not any(isinstance(p.data, DTensor) for p in model.parameters()):
        refuse_local_slices(model)
    entries = entries_of(model, out_dtype)
    writes = rank == 0 or distributed_checkpoint
    agree(prepare_directory(directory) if writes else None, group, what="prepare the save directory", outcome="nothing was written")
    staging = Staging(
        directory, weight_bytes=sum(e.nbytes for e in entries), writer=writes, max_shard_size_applies=not distributed_checkpoint
    )
    try:
        if distributed_checkpoint:
            save_sharded(model, directory, entries, group, rank, staging)
        else:
            save_gathered(model, directory, entries, group, rank, max_shard_size, staging)
    finally:
        staging.discard()  # every rank is past its last collective here, or failing anyway
