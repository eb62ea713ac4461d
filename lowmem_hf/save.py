"""Save: a plain or tensor-parallel model back to the Hub layout one tensor at a time, or as rank-local shards.

``save_pretrained(model, dir)`` writes what transformers' ``save_pretrained`` writes (``model.safetensors`` or
``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``, the config, the generation config;
tied weights once; the same shard split, by huggingface_hub's ``split_torch_state_dict_into_shards``), but
never builds a full state dict, nor even one full tensor: each safetensors header is computed from shapes up
front, then for every tensor each rank converts its local shard and sends it to rank 0, which ``pwrite``s the
shards one at a time at their places in the row-major layout. Rank 0 holds its local shard plus one received
shard of one tensor; the other ranks hold nothing beyond their shards.

``distributed_checkpoint=True`` writes each rank's local shards with no gather, in transformers' sharded format
(``shard-<rank+1>-model-00001-of-00001.safetensors`` with DCP's ``DCP_SHARDING_INFO`` offsets, what DCP's
``HuggingFaceStorageWriter`` writes), tied tensors once: ``from_pretrained`` of lowmem_hf reads it back at any
tp_size. Written by hand rather than through ``dcp.save`` because DCP's writer serializes each rank's whole file
in memory (``safetensors.torch.save``) and refuses tied tensors.

Crash safety: files are written as ``<name>.partial`` and renamed only after every rank reported success (a
collective status check, so a failure on one rank fails all, none hangs); the index is renamed last, so an
interrupted save never leaves a directory that looks complete.
"""

from __future__ import annotations

import copy
import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .plan.dtypes import parse_dtype
from .plan.sharding import box_runs

__all__ = ["save_pretrained"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PARTIAL = ".partial"
_WRITE_BYTES = 64 * 1024 * 1024  # bytes per write() call of a gathered tensor

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class _Entry:
    """One tensor to write: its name, the model's tensor (maybe a DTensor) and the dtype it is written in."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)  # global shape for a DTensor


def save_pretrained(
    model: Any,
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    distributed_checkpoint: bool = False,
) -> None:
    """Write ``model`` to ``save_directory`` one tensor at a time. Under tensor parallelism every rank must call it.

    Args:
        model: a transformers ``PreTrainedModel``, plain or with DTensor parameters (``tp_plan`` loads).
        save_directory: created if needed; shard files of an earlier save that this one does not write are removed.
        max_shard_size: as in transformers (``"5GB"``, or bytes).
        dtype: write floating tensors in this dtype (``torch.bfloat16`` or ``"bfloat16"``); ``None`` keeps each one's.
        distributed_checkpoint: write each rank's local shards (no gather), transformers' sharded format.

    Raises:
        OSError: ``save_directory`` cannot be written (raised on every rank before anything is written), or a
            rank failed while writing (every rank raises, naming the rank and file; the partial files are removed).
        ValueError: a model loaded with ``tp_rank``/``tp_size`` and no process group (its parameters are slices,
            which cannot be saved as full tensors), or a placement that cannot be saved.
        NotImplementedError: a 2-D (or larger) device mesh, or load-time key conversions that change names.

    Example:
        >>> lowmem_hf.save_pretrained(model, "out", dtype=torch.bfloat16)   # all TP ranks call it
    """
    directory = os.path.abspath(os.fspath(save_directory))
    out_dtype = parse_dtype(dtype, argument="dtype") if dtype is not None else None
    group = _group_of(model)
    rank = dist.get_rank(group) if group is not None else 0
    if not any(isinstance(p.data, DTensor) for p in model.parameters()):
        _refuse_local_slices(model)
    entries = _entries(model, out_dtype)
    writes = rank == 0 or distributed_checkpoint
    _agree(_writable(directory) if writes else None, group, what="check the save directory")
    if distributed_checkpoint:
        _save_sharded(model, directory, entries, group, rank)
    else:
        _save_gathered(model, directory, entries, group, rank, max_shard_size)


# ---------------------------------------------------------------------------------------------------------
# What to write
# ---------------------------------------------------------------------------------------------------------
def _group_of(model: Any):
    """The process group whose ranks all take part: the TP mesh's, else the default group, else none."""
    for p in model.parameters():
        if isinstance(p.data, DTensor):
            mesh = p.data.device_mesh
            if mesh.ndim != 1:
                raise NotImplementedError(
                    f"{type(model).__name__} is sharded over a {mesh.ndim}-D device mesh {mesh.mesh_dim_names}; "
                    "lowmem_hf.save_pretrained saves 1-D tensor-parallel models. Use transformers' save_pretrained."
                )
            return mesh.get_group()
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _refuse_local_slices(model: Any) -> None:
    """A model loaded with ``tp_rank``/``tp_size`` and no process group holds plain tensors that are slices: saving
    them as if they were full tensors would write a broken checkpoint. Compare with the shapes the config builds."""
    from .plan.skeleton import build_on_meta

    reference = build_on_meta(type(model), copy.deepcopy(model.config), model.dtype, (), {}).state_dict()
    for name, t in model.state_dict().items():
        want = reference.get(name)
        if want is not None and tuple(want.shape) != tuple(t.shape):
            raise ValueError(
                f"{name} has shape {list(t.shape)} but {type(model).__name__} built from its config has "
                f"{list(want.shape)}: this model holds one rank's slices (loaded with tp_rank/tp_size and no process "
                "group), not full tensors. Load it with tp_plan='auto' under torchrun (DTensor parameters) to save it, "
                "or load it whole."
            )


def _entries(model: Any, out_dtype: torch.dtype | None) -> list[_Entry]:
    """The tensors transformers' ``save_pretrained`` would write, in state-dict order, tied ones once."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    # transformers' own choice of which tied name stays (it compares storages, never reads data)
    state = remove_tied_weights_from_state_dict(state, model)
    # transformers reverts its load-time key conversions (and orders keys naturally, which decides the shard
    # split); done on meta here: only names and order are needed, and a conversion that changes keys is refused
    from transformers.core_model_loading import revert_weight_conversion

    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    reverted = revert_weight_conversion(model, meta)
    if set(reverted) != set(meta):
        raise NotImplementedError(
            f"{type(model).__name__} converts checkpoint keys on load (e.g. {sorted(set(reverted) ^ set(meta))[:2]}); "
            "reverting that needs several full tensors at once, which lowmem_hf.save_pretrained does not do. "
            "Use transformers' save_pretrained."
        )
    state = {k: state[k] for k in reverted}
    entries = []
    for name, t in state.items():
        if isinstance(t, DTensor) and not all(isinstance(p, (Shard, Replicate)) for p in t.placements):
            raise ValueError(
                f"{name} has placements {t.placements}: only Shard and Replicate tensors hold saved values "
                "(reduce a Partial tensor first)."
            )
        dt = out_dtype if out_dtype is not None and t.is_floating_point() else t.dtype
        if dt not in _ST_DTYPES:
            raise ValueError(f"{name} is {dt}, which safetensors cannot store; pass dtype= a float dtype.")
        entries.append(_Entry(name, t, dt))
    return entries


def _writable(directory: str) -> str | None:
    """``None`` if ``directory`` can take the files, else why not (nothing is written either way)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return f"cannot create the save directory {directory}: {e}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"the save directory {directory} is not writable by this process (check its permissions)"
    return None


def _agree(error: str | None, group, *, what: str) -> None:
    """Every rank learns whether any rank failed, and raises if so: no rank goes on into a collective alone."""
    errors = [error]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        text = "; ".join(f"rank {r}: {e}" for r, e in failed) if group is not None else failed[0][1]
        raise OSError(f"lowmem_hf.save_pretrained could not {what}, nothing was saved: {text}")


# ---------------------------------------------------------------------------------------------------------
# safetensors, one tensor at a time
# ---------------------------------------------------------------------------------------------------------
def _header(items: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """A safetensors header (8-byte length + JSON padded to 8 bytes) for tensors written in ``items`` order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dt, shape in items:
        nbytes = dt.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_tensor(f, t: torch.Tensor) -> None:
    """Append a tensor's bytes to ``f`` (the sharded save)."""
    t = t.contiguous()
    data = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    view = memoryview(data.numpy())
    for start in range(0, len(view), _WRITE_BYTES):
        f.write(view[start : start + _WRITE_BYTES])


def _as_shard(t: torch.Tensor) -> torch.Tensor:
    """``_StridedShard`` redistributed to the equivalent ``Shard`` (as transformers does before saving), so every
    rank's local tensor is one box of the global tensor."""
    placement = t.placements[0]
    if isinstance(placement, Shard) and type(placement) is not Shard:
        t = t.redistribute(placements=[Shard(placement.dim)])
    return t


def _pieces(entry: _Entry, world: int) -> list[tuple[int, int, int]] | None:
    """For a ``Shard(d)`` DTensor: every rank's ``(dim, offset, size)`` along ``d`` (torch.chunk's split), else None."""
    placement = entry.tensor.placements[0] if isinstance(entry.tensor, DTensor) else None
    if not isinstance(placement, Shard):
        return None
    n = entry.shape[placement.dim]
    return [(placement.dim, *reversed(Shard.local_shard_size_and_offset(n, world, r))) for r in range(world)]


def _write_gathered(fd: int | None, start: int, entry: _Entry, group, rank: int) -> None:
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
    t = _as_shard(t)
    local = t.to_local().to(entry.dtype).contiguous()
    world = t.device_mesh.size()
    pieces = _pieces(_Entry(entry.name, t, entry.dtype), world)
    if pieces is None:  # replicated: rank 0's copy is the tensor
        if rank == 0:
            _pwrite_runs(fd, start, local, [(0, 0, local.numel())], entry)
        return
    if rank != 0:
        if local.numel():
            dist.send(local.reshape(-1).view(torch.uint8), group=group, group_dst=0)
        return
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
        _pwrite_runs(fd, start, piece, runs, entry)
        del piece


def _pwrite_runs(fd: int | None, start: int, values: torch.Tensor, runs: list[tuple[int, int, int]], entry: _Entry) -> None:
    """``pwrite`` ``(src, dst, n)`` element runs of ``values`` to ``start + dst * itemsize``."""
    if fd is None or values.numel() == 0:
        return
    data = memoryview(values.reshape(-1).view(torch.uint8).numpy())
    size = entry.dtype.itemsize
    for src, dst, n in runs:
        view, offset = data[src * size : (src + n) * size], start + dst * size
        while len(view):
            written = os.pwrite(fd, view[:_WRITE_BYTES], offset)
            view, offset = view[written:], offset + written


class _Files:
    """This rank's files being written: ``<name>.partial`` until every rank agrees, then renamed in order."""

    def __init__(self, directory: str):
        self.directory = directory
        self.names: list[str] = []
        self.error: str | None = None

    def open(self, name: str):
        self.names.append(name)
        return open(os.path.join(self.directory, name + PARTIAL), "wb")

    def commit(self) -> None:
        for name in self.names:
            os.replace(os.path.join(self.directory, name + PARTIAL), os.path.join(self.directory, name))

    def discard(self) -> None:
        for name in self.names:
            try:
                os.remove(os.path.join(self.directory, name + PARTIAL))
            except FileNotFoundError:
                pass


def _save_gathered(model: Any, directory: str, entries: list[_Entry], group, rank: int, max_shard_size) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    by_name = {e.name: e for e in entries}
    meta = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    files = _Files(directory)
    if rank == 0:
        # an older index would make a save interrupted from here on look complete
        for stale in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME):
            if os.path.exists(os.path.join(directory, stale)):
                os.remove(os.path.join(directory, stale))
    for filename, names in split.filename_to_tensors.items():
        f = None
        header = _header([(n, by_name[n].dtype, by_name[n].shape) for n in names], {"format": "pt"})
        if rank == 0 and files.error is None:
            try:
                f = files.open(filename)
                f.write(header)
                f.flush()
            except OSError as e:
                files.error = f"{os.path.join(directory, filename)}: {e}"
        start = len(header)
        for name in names:
            entry = by_name[name]
            # every rank takes part in every tensor's exchange, even after a local failure, so none hangs
            try:
                _write_gathered(f.fileno() if f is not None and files.error is None else None, start, entry, group, rank)
            except OSError as e:
                files.error = f"{os.path.join(directory, filename)}: {e}"
            start += entry.dtype.itemsize * int(torch.Size(entry.shape).numel())
        if f is not None:
            f.close()
    _finish(files, group, rank, lambda: _write_metadata(model, directory, split, entries))


def _finish(files: _Files, group, rank: int, rank0_after) -> None:
    """Collective status check, then rename; rank 0 writes config/index last. All ranks return together."""
    try:
        _agree(files.error, group, what="write the checkpoint")
    except OSError:
        files.discard()
        raise
    files.commit()
    if rank == 0:
        rank0_after()
    if group is not None:
        dist.barrier(group=group)


def _write_metadata(model: Any, directory: str, split, entries: list[_Entry]) -> None:
    """Config, generation config, stale shards removed, and the index last (renamed into place)."""
    _save_configs(model, directory, entries)
    pattern = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    for name in os.listdir(directory):
        if (pattern.fullmatch(name) or name == SAFE_WEIGHTS_NAME) and name not in split.filename_to_tensors:
            os.remove(os.path.join(directory, name))
    index_path = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": model.num_parameters(), **split.metadata},
            "weight_map": split.tensor_to_filename,
        }
        with open(index_path + PARTIAL, "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(index_path + PARTIAL, index_path)
    elif os.path.exists(index_path):
        os.remove(index_path)  # a stale index would point at shards that are gone


def _save_configs(model: Any, directory: str, entries: list[_Entry]) -> None:
    config = copy.deepcopy(model.config)
    floating = [e.dtype for e in entries if e.dtype.is_floating_point]
    written = floating[0] if floating else model.dtype
    config.dtype = str(written).split(".")[1]  # as transformers records it
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


# ---------------------------------------------------------------------------------------------------------
# Sharded (no gather)
# ---------------------------------------------------------------------------------------------------------
def _local_part(entry: _Entry, rank: int) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """This rank's stored chunk of a tensor and its global offsets, or ``None`` if another rank stores it.

    Replicated tensors (and plain ones in a TP model) are stored once, by rank 0. ``_StridedShard`` is
    redistributed to the equivalent ``Shard`` first (as transformers does), so every chunk is one box.
    """
    t = entry.tensor.detach()
    ndim = len(entry.shape)
    if not isinstance(t, DTensor):
        return (t if rank == 0 else None), (0,) * ndim
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    t = _as_shard(t)
    if isinstance(t.placements[0], Replicate):
        return (t.to_local() if t.device_mesh.get_local_rank() == 0 else None), (0,) * ndim
    _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(int(o) for o in offsets)


def _save_sharded(model: Any, directory: str, entries: list[_Entry], group, rank: int) -> None:
    from torch.distributed.checkpoint._hf_utils import (
        CUSTOM_METADATA_KEY, DCP_VERSION_KEY, FORMAT_KEY, FORMAT_VALUE, HF_DCP_VERSION, SAVED_OFFSETS_KEY, _gen_file_name,
    )

    parts = []
    for entry in entries:
        local, offsets = _local_part(entry, rank)
        if local is not None:
            parts.append((entry, local, offsets))
    files = _Files(directory)
    if parts:
        name = _gen_file_name(1, 1, rank + 1)
        info = {e.name: {SAVED_OFFSETS_KEY: list(off)} for e, _, off in parts}
        metadata = {CUSTOM_METADATA_KEY: json.dumps(info), DCP_VERSION_KEY: str(HF_DCP_VERSION), FORMAT_KEY: FORMAT_VALUE}
        try:
            with files.open(name) as f:
                f.write(_header([(e.name, e.dtype, tuple(local.shape)) for e, local, _ in parts], metadata))
                for e, local, _ in parts:
                    _write_tensor(f, local.to(e.dtype))
        except OSError as e:
            files.error = f"{os.path.join(directory, name)}: {e}"
    written = [files.names]
    if group is not None:
        written = [None] * dist.get_world_size(group)
        dist.all_gather_object(written, files.names, group=group)
    keep = {n for names in written for n in names}
    pattern = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")

    def rank0_after() -> None:
        # stale shards of an earlier save (e.g. with more ranks) would be read as part of this checkpoint
        for stale in [n for n in os.listdir(directory) if pattern.fullmatch(n) and n not in keep]:
            os.remove(os.path.join(directory, stale))
        _save_configs(model, directory, entries)

    _finish(files, group, rank, rank0_after)
