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

Crash safety, "write aside, switch at the end": every new file is written into ``<dir>/.lowmem_hf_save.partial/``
and fsync'd. Only after every rank reported success (a collective status check: a failure on one rank fails all,
none hangs) are they renamed into place, in an order that leaves a loader a complete checkpoint at every instant.
transformers and lowmem_hf read ``model.safetensors`` when it is there, else ``model.safetensors.index.json`` and
the shards it names; so a one-file checkpoint switches with the rename of ``model.safetensors``, a sharded one with
the rename of its index (or, when an older ``model.safetensors`` was what loaders read, with its removal). Shard
names that the live index still names are replaced only after the index has been pointed at second names (hard
links) of the new shards. The previous checkpoint's files go only after the switch. A failed save removes what it
wrote and leaves the folder as it was; a killed save leaves the old or the new checkpoint loadable, plus at most the
staging folder and (killed mid-switch) the second names, which the next save removes. The rank-local format (``distributed_checkpoint=True``) has no index to switch: its old rank files are
removed just before the new ones are renamed in, so a kill in that moment leaves a folder that does not load
(lowmem_hf checks that the rank files cover every tensor), never one that mixes two saves.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .compat.torch_api import hf_rank_shard
from .compat.transformers_api import keys_to_ignore_on_save
from .distributed import local_intervals
from .plan.dtypes import check_float_dtype, parse_dtype
from .runs import box_runs

__all__ = ["save_pretrained"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
STAGING = ".lowmem_hf_save.partial"  # the folder inside save_directory where new files are written aside
_WRITE_BYTES = 64 * 1024 * 1024  # bytes per write() call of a gathered tensor
_HUB_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_RANK_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")
_SECOND_NAME = re.compile(r"model-\d{5}-of-\d{5}\.next\.safetensors")  # see _point_index_at_second_names

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

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class _Failure:
    """Why one rank could not do its part of a save; sent to every rank by ``_agree``."""

    errno: int | None
    """The OS error number (``errno.ENOSPC``...), or ``None`` for an error that is not an ``OSError``."""
    text: str
    """What failed, naming the file, with the bytes needed where known."""


def save_pretrained(
    model: Any,
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    distributed_checkpoint: bool = False,
) -> None:
    """Write ``model`` to ``save_directory`` one tensor at a time. Under tensor parallelism every rank must call it.

    A checkpoint already in ``save_directory`` stays loadable until the new one is complete (see the module
    docstring); then it is replaced whole, none of its shards left behind.

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
    group = _group_of(model)
    rank = dist.get_rank(group) if group is not None else 0
    if not any(isinstance(p.data, DTensor) for p in model.parameters()):
        _refuse_local_slices(model)
    entries = _entries(model, out_dtype)
    writes = rank == 0 or distributed_checkpoint
    _agree(_prepare_directory(directory) if writes else None, group, what="prepare the save directory", outcome="nothing was written")
    staging = _Staging(
        directory, weight_bytes=sum(e.nbytes for e in entries), writer=writes, max_shard_size_applies=not distributed_checkpoint
    )
    try:
        if distributed_checkpoint:
            _save_sharded(model, directory, entries, group, rank, staging)
        else:
            _save_gathered(model, directory, entries, group, rank, max_shard_size, staging)
    finally:
        staging.discard()  # every rank is past its last collective here, or failing anyway


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
    for key in keys_to_ignore_on_save(model):
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


def _prepare_directory(directory: str) -> _Failure | None:
    """``None`` if ``directory`` can take the files, else why not (nothing is written either way). Removes what a
    killed save left in the staging folder."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        return _Failure(e.errno, f"cannot create the save directory {directory}: {e.strerror or e}")
    if not os.access(directory, os.W_OK | os.X_OK):
        return _Failure(errno.EACCES, f"the save directory {directory} is not writable by this process (check its permissions)")
    shutil.rmtree(os.path.join(directory, STAGING), ignore_errors=True)
    return None


def _agree(failure: _Failure | None, group, *, what: str, outcome: str, cause: BaseException | None = None) -> None:
    """Every rank learns whether any rank failed, and raises if so: no rank goes on into a collective alone.

    The error is an ``OSError`` with the first failing rank's ``errno`` (``PermissionError`` for ``EACCES``...);
    ``cause`` (this rank's own exception, if any) is chained to it.
    """
    failures = [failure]
    if group is not None:
        failures = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, failure, group=group)
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        text = "; ".join(f"rank {r}: {f.text}" for r, f in failed) if group is not None else failed[0][1].text
        message = f"lowmem_hf.save_pretrained could not {what}, {outcome}: {text}"
        code = failed[0][1].errno
        raise (OSError(code, message) if code is not None else OSError(message)) from cause


# ---------------------------------------------------------------------------------------------------------
# Written aside, then switched
# ---------------------------------------------------------------------------------------------------------
class _Staging:
    """This rank's new files, written into ``<directory>/.lowmem_hf_save.partial/`` and fsync'd; moved into place
    by the switch after every rank agreed, removed otherwise. The first failure is kept (with the bytes needed)
    and the rank goes on taking part in every exchange, so that no other rank hangs."""

    def __init__(self, directory: str, *, weight_bytes: int, writer: bool, max_shard_size_applies: bool):
        self.directory = directory
        self.folder = os.path.join(directory, STAGING)
        self.writer = writer
        self.max_shard_size_applies = max_shard_size_applies
        """Whether a smaller ``max_shard_size`` makes smaller files (not in the rank-local format)."""
        self.weight_bytes = weight_bytes
        """The new checkpoint's tensor bytes (all ranks together)."""
        self.free_bytes = _free_bytes(directory) if writer else None
        """What the device had free when the save began (``None``: unknown)."""
        self.names: list[str] = []
        """The weight files this rank wrote, in order."""
        self.configs: list[str] = []
        """The config files rank 0 wrote (config.json, generation_config.json, remote code)."""
        self.failure: _Failure | None = None
        self.cause: BaseException | None = None

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def create(self, name: str, size: int, *, weights: bool = True) -> int | None:
        """A new file of ``size`` bytes open for writing, or ``None`` once this rank has failed."""
        if self.failure is not None:
            return None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        except OSError as e:
            self.fail(name, e, size)
            return None
        if weights:
            self.names.append(name)
        return fd

    def close(self, fd: int | None, name: str, size: int) -> None:
        """fsync (some file systems report a full disk only here) and close."""
        if fd is None:
            return
        try:
            if self.failure is None:
                os.fsync(fd)
        except OSError as e:
            self.fail(name, e, size)
        finally:
            try:
                os.close(fd)
            except OSError as e:
                self.fail(name, e, size)

    def write_file(self, name: str, data: bytes) -> None:
        """A small file, whole (the index)."""
        fd = self.create(name, len(data), weights=False)
        if fd is not None:
            try:
                _pwrite_all(fd, memoryview(data), 0)
            except OSError as e:
                self.fail(name, e, len(data))
            self.close(fd, name, len(data))

    def write_configs(self, model: Any, entries: list[_Entry]) -> None:
        """The config and generation config, by transformers' own ``save_pretrained``, into a folder of their own."""
        if self.failure is not None:
            return
        folder = self.path("config")
        config = copy.deepcopy(model.config)
        floating = [e.dtype for e in entries if e.dtype.is_floating_point]
        written = floating[0] if floating else model.dtype
        config.dtype = str(written).split(".")[1]  # as transformers records it
        config.architectures = [type(model).__name__]
        steps = [("config.json", lambda: config.save_pretrained(folder))]
        if model.can_generate() and getattr(model, "generation_config", None) is not None:
            steps.append(("generation_config.json", lambda: model.generation_config.save_pretrained(folder)))
        for name, step in steps:
            try:
                step()
            except Exception as e:  # transformers' validation too: every rank must learn of it
                self.fail(name, e, None)
                return
        self.configs = sorted(os.listdir(folder))

    def fail(self, name: str, error: BaseException, size: int | None) -> None:
        """Keep the first failure, described for the user: the file's final path, why, and the bytes needed."""
        if self.failure is not None:
            return
        path = os.path.join(self.directory, name)
        if not isinstance(error, OSError):
            self.failure, self.cause = _Failure(None, f"{path}: {type(error).__name__}: {error}"), error
            return
        text = f"writing {path}: {error.strerror or error}"
        code = error.errno
        if code in (errno.ENOSPC, errno.EDQUOT):
            needs = f"The file needs {size} bytes and the" if size is not None else "The"
            text += (
                f". {needs} new checkpoint's weights need {self.weight_bytes} bytes in all, next to the files already "
                "in the folder (those are replaced only once the new ones are complete)"
            )
            if self.free_bytes is not None:
                short = self.weight_bytes - self.free_bytes
                text += f"; the device had {self.free_bytes} bytes free when the save began"
                text += f", {short} bytes short" if short > 0 else ""
            text += ". Free space on the device, or save to another folder."
        elif code == errno.EFBIG:
            text += f" (it needs {size} bytes, more than one file may hold here)"
            text += ". Pass a smaller max_shard_size." if self.max_shard_size_applies else "."
        elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
            text += f". Check the permissions of {self.directory}."
        self.failure, self.cause = _Failure(code, text), error

    def discard(self) -> None:
        """Remove the staging folder and whatever is left in it (after a failure: everything this save wrote)."""
        if self.writer:
            shutil.rmtree(self.folder, ignore_errors=True)


def _free_bytes(directory: str) -> int | None:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset``, ``_WRITE_BYTES`` per call, through short writes."""
    while len(view):
        written = os.pwrite(fd, view[:_WRITE_BYTES], offset)
        view, offset = view[written:], offset + written


def _live_weights(directory: str) -> set[str]:
    """The weight files a loader reads in ``directory`` now: ``model.safetensors`` if it is there (transformers and
    lowmem_hf look for it first), else the index and the files it names."""
    if os.path.isfile(os.path.join(directory, SAFE_WEIGHTS_NAME)):
        return {SAFE_WEIGHTS_NAME}
    index = os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME)
    if not os.path.isfile(index):
        return set()
    try:
        with open(index, encoding="utf-8") as f:
            named = {v for v in json.load(f)["weight_map"].values() if isinstance(v, str) and os.sep not in v}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        named = set()  # an unreadable index: nothing loads from it anyway
    return {SAFE_WEIGHTS_INDEX_NAME} | named


def _is_weight_file(name: str) -> bool:
    """A file a save of lowmem_hf (or transformers) writes, hence replaced by the next save into the folder."""
    return name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or any(
        p.fullmatch(name) for p in (_HUB_SHARD, _RANK_SHARD, _SECOND_NAME)
    )


def _remove(directory: str, name: str) -> None:
    try:
        os.remove(os.path.join(directory, name))
    except FileNotFoundError:
        pass


def _fsync_directory(directory: str) -> None:
    """Make the renames durable (best effort: some file systems cannot fsync a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _move_configs(staging: _Staging) -> None:
    for name in staging.configs:
        os.replace(os.path.join(staging.path("config"), name), os.path.join(staging.directory, name))


def _switch_gathered(staging: _Staging, index: dict | None) -> None:
    """Rank 0, after every rank agreed: move the new files into place so that a loader sees the old checkpoint,
    then the new one, never a mix; then remove what the old one held and the new one does not."""
    directory, weights = staging.directory, staging.names
    live = _live_weights(directory)
    _move_configs(staging)  # small, and a checkpoint step rarely changes them
    if index is None:
        os.replace(staging.path(SAFE_WEIGHTS_NAME), os.path.join(directory, SAFE_WEIGHTS_NAME))  # the switch
    else:
        if live & set(weights):
            _point_index_at_second_names(staging, index)  # the switch, when the old index was live
        for name in weights:
            os.replace(staging.path(name), os.path.join(directory, name))
        os.replace(staging.path(SAFE_WEIGHTS_INDEX_NAME), os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME))  # or here
        _remove(directory, SAFE_WEIGHTS_NAME)  # the switch, when an older model.safetensors was live
    _fsync_directory(directory)
    keep = set(weights) | ({SAFE_WEIGHTS_INDEX_NAME} if index is not None else set())
    for name in os.listdir(directory):
        if name not in keep and (_is_weight_file(name) or (name in live and name.endswith(".safetensors"))):
            _remove(directory, name)


def _point_index_at_second_names(staging: _Staging, index: dict) -> None:
    """The live index names files the new shards are about to replace. Give every new shard a second name (a hard
    link, no copy), then point the live index at those: the new checkpoint is then what loaders read, and the
    final names can be replaced. Where the file system has no hard links, remove the old index instead: until the
    new one is renamed in the folder does not load (it never mixes two checkpoints)."""
    directory = staging.directory
    second = {name: name.removesuffix(".safetensors") + ".next.safetensors" for name in staging.names}
    try:
        for name, other in second.items():
            _remove(directory, other)
            os.link(staging.path(name), os.path.join(directory, other))
    except OSError:
        for other in second.values():
            _remove(directory, other)
        _remove(directory, SAFE_WEIGHTS_INDEX_NAME)
        return
    bridge = dict(index, weight_map={k: second[v] for k, v in index["weight_map"].items()})
    path = staging.path(SAFE_WEIGHTS_INDEX_NAME + ".next")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(bridge, indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(path, os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME))


def _switch_rank_files(staging: _Staging, group, rank: int, keep: set[str]) -> None:
    """Every rank, after every rank agreed: move the rank files of ``distributed_checkpoint=True`` into place.

    That format has no index: loaders read every ``shard-*`` file, unless a Hub-layout checkpoint is there, which
    takes precedence. So with none there, rank 0 removes the old rank files before any new one lands (a reader sees
    an incomplete set, never old and new files together); then every rank renames its file; then rank 0 removes
    a Hub-layout checkpoint (the switch, if it was live: the index first, ``model.safetensors`` last) and the rank
    files of an earlier save with more ranks.
    """
    directory = staging.directory

    def step(action, ranks) -> None:
        failure = None
        if ranks is None or rank in ranks:
            try:
                action()
            except OSError as e:
                failure = _Failure(e.errno, f"moving the new files into {directory}: {e}")
        _agree(failure, group, what="switch to the new checkpoint", outcome="the folder may hold no complete checkpoint")

    def clear_old_rank_files() -> None:
        _move_configs(staging)
        if not _live_weights(directory):
            for name in os.listdir(directory):
                if _RANK_SHARD.fullmatch(name):
                    _remove(directory, name)

    def move_own_files() -> None:
        for name in staging.names:
            os.replace(staging.path(name), os.path.join(directory, name))
        _fsync_directory(directory)

    def remove_the_rest() -> None:
        for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME):
            _remove(directory, name)
        for name in os.listdir(directory):
            if _is_weight_file(name) and name not in keep:
                _remove(directory, name)

    step(clear_old_rank_files, ranks=(0,))
    step(move_own_files, ranks=None)
    step(remove_the_rest, ranks=(0,))  # the ranks return together


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


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    t = t.contiguous()
    return memoryview((t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)).numpy())


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


def _pwrite_runs(fd: int | None, start: int, values: torch.Tensor, runs: list[tuple[int, int, int]], entry: _Entry) -> None:
    """``pwrite`` ``(src, dst, n)`` element runs of ``values`` to ``start + dst * itemsize``."""
    if fd is None or values.numel() == 0:
        return
    data = memoryview(values.reshape(-1).view(torch.uint8).numpy())
    size = entry.dtype.itemsize
    for src, dst, n in runs:
        _pwrite_all(fd, data[src * size : (src + n) * size], start + dst * size)



def _save_gathered(model: Any, directory: str, entries: list[_Entry], group, rank: int, max_shard_size, staging: _Staging) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards

    by_name = {e.name: e for e in entries}
    meta = {e.name: torch.empty(e.shape, dtype=e.dtype, device="meta") for e in entries}
    split = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size)
    headers = {
        filename: _header([(n, by_name[n].dtype, by_name[n].shape) for n in names], {"format": "pt"})
        for filename, names in split.filename_to_tensors.items()
    }
    staging.weight_bytes = sum(len(h) for h in headers.values()) + sum(e.nbytes for e in entries)  # exact: headers too
    for filename, names in split.filename_to_tensors.items():
        header = headers[filename]
        size = len(header) + sum(by_name[n].nbytes for n in names)
        fd = staging.create(filename, size) if rank == 0 else None
        try:
            if fd is not None:
                _pwrite_all(fd, memoryview(header), 0)
        except OSError as e:
            staging.fail(filename, e, size)
        start = len(header)
        for name in names:
            entry = by_name[name]
            # every rank takes part in every tensor's exchange, even after a local failure, so none hangs
            try:
                _write_gathered(fd if staging.failure is None else None, start, entry, group, rank)
            except OSError as e:
                staging.fail(filename, e, size)
            start += entry.nbytes
        staging.close(fd, filename, size)
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": model.num_parameters(), **split.metadata}, "weight_map": split.tensor_to_filename}
    if rank == 0:
        if index is not None:
            staging.write_file(SAFE_WEIGHTS_INDEX_NAME, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode())
        staging.write_configs(model, entries)
    unchanged = f"nothing in {directory} changed (the new files were written aside and are removed)"
    _agree(staging.failure, group, what="write the checkpoint", outcome=unchanged, cause=staging.cause)
    failure = None
    if rank == 0:
        try:
            _switch_gathered(staging, index)
        except OSError as e:
            failure = _Failure(e.errno, f"moving the new files into {directory}: {e}")
    _agree(failure, group, what="switch to the new checkpoint", outcome="the folder loads the old or the new checkpoint")


def _local_part(entry: _Entry, rank: int) -> tuple[torch.Tensor | None, tuple[int, ...]]:
    """This rank's stored chunk of a tensor and its global offsets, or ``None`` if another rank stores it.

    Replicated tensors (and plain ones in a TP model) are stored once, by rank 0. ``_StridedShard`` is
    redistributed to the equivalent ``Shard`` first (as transformers does), so every chunk is one box.
    """
    t = entry.tensor.detach()
    ndim = len(entry.shape)
    if not isinstance(t, DTensor):
        return (t if rank == 0 else None), (0,) * ndim
    t = _as_shard(t)
    if isinstance(t.placements[0], Replicate):
        return (t.to_local() if t.device_mesh.get_local_rank() == 0 else None), (0,) * ndim
    intervals = local_intervals(tuple(t.shape), t.placements, tuple(t.device_mesh.shape), t.device_mesh.get_coordinate())
    return t.to_local(), tuple(runs[0][0] if runs else 0 for runs in intervals)


def _save_sharded(model: Any, directory: str, entries: list[_Entry], group, rank: int, staging: _Staging) -> None:
    parts = []
    for entry in entries:
        local, offsets = _local_part(entry, rank)
        if local is not None:
            parts.append((entry, local, offsets))
    if parts:
        name, metadata = hf_rank_shard(rank, {e.name: list(off) for e, _, off in parts})
        header = _header([(e.name, e.dtype, tuple(local.shape)) for e, local, _ in parts], metadata)
        size = len(header) + sum(e.dtype.itemsize * local.numel() for e, local, _ in parts)
        fd = staging.create(name, size)
        if fd is not None:
            try:
                _pwrite_all(fd, memoryview(header), 0)
                offset = len(header)
                for e, local, _ in parts:
                    data = _tensor_bytes(local.to(e.dtype))
                    _pwrite_all(fd, data, offset)
                    offset += len(data)
            except OSError as e:
                staging.fail(name, e, size)
            staging.close(fd, name, size)
    if rank == 0:
        staging.write_configs(model, entries)
    written = [staging.names]
    if group is not None:
        written = [None] * dist.get_world_size(group)
        dist.all_gather_object(written, staging.names, group=group)
    unchanged = f"nothing in {directory} changed (the new files were written aside and are removed)"
    _agree(staging.failure, group, what="write the checkpoint", outcome=unchanged, cause=staging.cause)
    _switch_rank_files(staging, group, rank, keep={n for names in written for n in names})
