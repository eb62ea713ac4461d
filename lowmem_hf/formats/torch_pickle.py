"""torch pickles (``pytorch_model.bin``): ``torch.save`` zip archives since torch 1.6, legacy pickle streams before.

What only this format knows: learning shapes and dtypes without the data (``read_header``: a zip archive is
unpickled onto ``meta``), where each tensor's bytes are in the file, checked against the archive's own directory
(``zip_archive.read_archive``, ``read_storages``), and reading them (``TorchReader``).

- zip: every storage is one uncompressed member ``<archive>/data/<key>``; a row-major tensor is one byte range of
  the file, read with ``preadv`` like a safetensors tensor (``base.RangeReader``: slices, staging, read-ahead
  hints). Not through ``torch.load(mmap=True)``: a file truncated or rewritten under a mapping kills the process
  with SIGBUS when a page is touched, where ``preadv`` returns short and the error names the file. The archive is
  read again through the reader's own descriptor when its first tensor is read (every tensor must still be where
  the plan found it) and its directory once more after its last (a file rewritten in between is an error, not a
  mix of two checkpoints). A tensor stored with other strides or byte order is read as its storage span and
  copied strided.
- legacy pickle: has no random access; the shard is loaded whole (the report says what it cost).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
import zipfile
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, BinaryIO, Callable, Mapping

import torch

from ..errors import CorruptCheckpointError
from ..runs import element_runs, slice_tensor
from ..sources import ByteSource
from ..sources.local import LocalFiles
from ..types import Checkpoint, CheckpointFormat, LoadPlan, ShardSpec, TensorInfo
from .base import RangeReader, Reader, SourceFile, StreamStats, byte_view
from .zip_archive import RESAVE, Archive, ZipMember, byte_order, member_error, read_archive

__all__ = [
    "StoredTensor", "unpickle_locations", "check_in_storage", "read_storages", "read_header",
    "TorchReader", "open_reader", "staging_bytes",
]


@dataclass(frozen=True)
class StoredTensor:
    """Where a pickled tensor's values are: in storage ``storage`` (member ``data/<storage>``), from element
    ``storage_offset``, with ``stride``."""

    storage: str
    storage_nbytes: int
    """The storage's bytes, as the pickle records them (its member must hold exactly these)."""
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def row_major(self) -> bool:
        expected = tuple(math.prod(self.shape[d + 1 :]) for d in range(len(self.shape)))
        return all(st == e for st, e, n in zip(self.stride, expected, self.shape) if n > 1)

    @property
    def span(self) -> tuple[int, int]:
        """``[first, last]`` elements of the storage the tensor touches (``(offset, offset - 1)`` when empty)."""
        if math.prod(self.shape) == 0:
            return self.storage_offset, self.storage_offset - 1
        return self.storage_offset, self.storage_offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride))


# The storage classes torch.save names in a pickle, for the dtypes it had before torch.dtype was pickled itself
# (torch/storage.py ``_dtype_to_storage_type_map``; quantized ones are not plain tensors).
_LEGACY_STORAGES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16, "LongStorage": torch.int64,
    "IntStorage": torch.int32, "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "BFloat16Storage": torch.bfloat16, "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


def _rebuild_v2(storage, storage_offset, size, stride, *rest) -> StoredTensor:
    key, dtype, nbytes = storage
    return StoredTensor(key, nbytes, dtype, storage_offset, tuple(size), tuple(stride))


def _rebuild_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, *rest) -> StoredTensor:
    key, _, nbytes = storage  # an untyped (byte) storage; the tensor's dtype is pickled itself
    return StoredTensor(key, nbytes, dtype, storage_offset, tuple(size), tuple(stride))


class _StoragePickle(pickle.Unpickler):
    """Reads a ``torch.save`` ``data.pkl`` into its structure with a ``StoredTensor`` for each tensor: only the
    names a state dict of plain tensors and parameters uses are allowed (anything else raises, as ``weights_only``
    would). torch's own loader keeps these locations to itself."""

    _GLOBALS = {
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): lambda data, *rest: data,
        ("torch._utils", "_rebuild_parameter_with_state"): lambda data, *rest: data,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch.storage", "UntypedStorage"): torch.uint8,
        ("torch", "UntypedStorage"): torch.uint8,
    }

    def find_class(self, module: str, name: str):
        found = self._GLOBALS.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in _LEGACY_STORAGES:
            return _LEGACY_STORAGES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a state dict of plain tensors")

    def persistent_load(self, pid):
        _, dtype, key, _, numel = pid  # ('storage', storage type (here its dtype), key, location, numel)
        return str(key), dtype, int(numel) * dtype.itemsize


def unpickle_locations(f: BinaryIO, archive: Archive, *, name: str) -> Any:
    """The object pickled in ``archive``'s ``data.pkl`` (``f`` is the archive's file), with a ``StoredTensor`` for
    each tensor, or None where it holds more than plain tensors and parameters (tensor subclasses, other objects):
    torch's own loader is then the only reader of it."""
    pkl = archive.members.get("data.pkl")
    if pkl is None:
        raise CorruptCheckpointError(f"{name}: the archive has no data.pkl member. {RESAVE}")
    f.seek(pkl.data_offset)
    try:
        return _StoragePickle(io.BytesIO(f.read(pkl.size))).load()
    except CorruptCheckpointError:
        raise
    except Exception:  # noqa: BLE001 - anything this restricted reader does not know goes to torch's loader
        return None


def check_in_storage(key: str, t: StoredTensor, archive: Archive, *, name: str) -> ZipMember:
    """``t``'s storage member, checked: it holds exactly the storage's bytes, and the tensor lies inside it.

    Raises:
        CorruptCheckpointError: the pickle and the zip directory disagree.
    """
    member = archive.members.get(f"data/{t.storage}")
    if member is None:
        raise CorruptCheckpointError(
            f"{name}: tensor {key!r} is stored in storage {t.storage!r}, but the archive has no member data/{t.storage}. {RESAVE}"
        )
    if member.size != t.storage_nbytes:
        raise member_error(
            name, f"data/{t.storage}", "member sizes",
            f"{t.storage_nbytes} bytes (what the pickle says storage {t.storage!r} of {key!r} holds)", f"{member.size} bytes in the zip directory",
        )
    first, last = t.span
    itemsize = t.dtype.itemsize
    if first < 0 or (last + 1) * itemsize > t.storage_nbytes or len(t.stride) != len(t.shape) or any(s < 0 for s in t.stride):
        raise CorruptCheckpointError(
            f"{name}: tensor {key!r} ({t.dtype}, shape {list(t.shape)}, stride {list(t.stride)}, offset {t.storage_offset}) "
            f"reaches bytes [{first * itemsize}, {(last + 1) * itemsize}) of storage {t.storage!r}, which holds {t.storage_nbytes}. {RESAVE}"
        )
    return member


def read_storages(f: BinaryIO, archive: Archive, *, name: str) -> dict[str, StoredTensor] | None:
    """Where each tensor of the state dict pickled in ``archive`` is (``f`` is the archive's file), each checked
    against its storage member (``check_in_storage``); None where the pickle holds more than plain tensors.

    Raises:
        CorruptCheckpointError: a tensor and its storage member disagree.
    """
    state = unpickle_locations(f, archive, name=name)
    if not isinstance(state, dict) or not all(isinstance(v, StoredTensor) for v in state.values()):
        return None
    for key, t in state.items():
        check_in_storage(key, t, archive, name=name)
    return state


def _raw_offset(t: StoredTensor, archive: Archive, byte_order: str) -> int | None:
    """The tensor's first byte in the file when its bytes are raw row-major native-order values, else None."""
    if not t.row_major or byte_order != sys.byteorder:
        return None
    return archive.members[f"data/{t.storage}"].data_offset + t.storage_offset * t.dtype.itemsize


def read_header(path: str, *, weights_only: bool) -> tuple[dict[str, TensorInfo], int, str]:
    """Shapes and dtypes of a ``torch.save`` file without reading tensor data.

    A zip archive's directory is checked (``read_archive``) and its pickle read for where each tensor is
    (``read_storages``; a pickle of plain tensors needs nothing more, and holds nothing ``weights_only`` would
    refuse); a pickle of anything else is unpickled by torch onto ``meta``. A legacy pickle stream interleaves data
    and pickle, so learning its shapes reads the whole file once.

    Returns:
        ``({key: TensorInfo}, bytes_read, CheckpointFormat)``; a row-major zip tensor's ``TensorInfo.offset`` is
        where its bytes start in the file.

    Raises:
        CorruptCheckpointError: torch cannot read it, it is not a state dict of tensors, or its archive is damaged.
    """
    if not zipfile.is_zipfile(path):
        state = _load_meta(path, weights_only=weights_only)
        infos = {k: TensorInfo(key=k, file=path, dtype=v.dtype, shape=tuple(v.shape), offset=None) for k, v in state.items()}
        return infos, os.path.getsize(path), CheckpointFormat.TORCH_LEGACY
    with open(path, "rb", buffering=0) as f:
        if hasattr(os, "posix_fadvise"):  # the local headers are spread over the file: read only their pages
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        archive = read_archive(f, name=path)
        stored = read_storages(f, archive, name=path)
        order = byte_order(f, archive)
    nbytes = archive.bytes_read + archive.members["data.pkl"].size
    if stored is None:  # more than plain tensors: torch's loader decides (weights_only), and reads it whole later
        state = _load_meta(path, weights_only=weights_only)
        infos = {k: TensorInfo(key=k, file=path, dtype=v.dtype, shape=tuple(v.shape), offset=None) for k, v in state.items()}
        return infos, nbytes, CheckpointFormat.TORCH_ZIP
    infos = {
        key: TensorInfo(key=key, file=path, dtype=t.dtype, shape=t.shape, offset=_raw_offset(t, archive, order))
        for key, t in stored.items()
    }
    return infos, nbytes, CheckpointFormat.TORCH_ZIP


def _load_meta(path: str, *, weights_only: bool) -> dict[str, torch.Tensor]:
    """``torch.load`` onto ``meta``: a state dict of tensors, or the named error."""
    try:
        state = torch.load(path, map_location="meta", weights_only=weights_only, mmap=False)
    except Exception as e:  # torch raises a zoo of types here (UnpicklingError, RuntimeError, EOFError...)
        hint = (
            " If you trust this file, pass weights_only=False to allow arbitrary pickles."
            if weights_only and "weights_only" in str(e)
            else " The file is corrupt or not a torch.save checkpoint: download or copy it again."
        )
        raise CorruptCheckpointError(f"{path}: torch.load could not read it ({type(e).__name__}: {e}).{hint}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptCheckpointError(
            f"{path} holds a {type(state).__name__}, not a state dict of tensors; save weights with "
            "torch.save(model.state_dict(), path)."
        )
    return state


# ---------------------------------------------------------------------------------------------------------
# Read
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Opened:
    """A shard as its reader found it when it read the shard's first tensor."""

    stored: Mapping[str, StoredTensor] | None = None
    """zip: where each tensor is."""
    archive: Archive | None = None
    byte_order: str = "little"
    directory: bytes = b""
    """zip: the central directory's bytes, compared again after the last read."""
    whole: Mapping[str, torch.Tensor] | None = None
    """A legacy pickle (or a zip pickle of more than plain tensors): the shard loaded whole by torch."""


class TorchReader(RangeReader):
    """Reads ``torch.save`` shards from local files (``source``; None: each ``TensorInfo.file`` is a local path):
    zip archives by byte ranges (``RangeReader``), legacy pickles loaded whole, one at a time."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, weights_only: bool, stats: StreamStats, source: LocalFiles | None = None):
        super().__init__(plan_counts, chunk_bytes, stats, source if source is not None else LocalFiles())
        self._weights_only = weights_only
        self._opened: dict[str, _Opened] = {}

    def _open(self, file: str) -> _Opened:
        """The shard as it is now, read through the source's descriptor (the one every tensor read uses) once."""
        opened = self._opened.get(file)
        if opened is not None:
            return opened
        self._source.open(file)  # the shard must still be the one whose header was read
        path = self._source.path(file)
        size = os.path.getsize(path)
        if zipfile.is_zipfile(path):
            f = SourceFile(self._source, file, 0, size)  # the descriptor the tensor reads use, not the path again
            try:
                archive = read_archive(f, name=file)
                stored = read_storages(f, archive, name=file)
            except CorruptCheckpointError:
                self._source.check_unchanged(file)  # it was fine when planned: say that it changed, if it did
                raise
            if stored is not None:
                order = byte_order(f, archive)
                start, end = archive.directory
                f.seek(start)
                opened = _Opened(stored=stored, archive=archive, byte_order=order, directory=f.read(end - start))
        if opened is None:
            opened = self._load_whole(file, path)
        self._opened[file] = opened
        self._stats.opened(file)
        return opened

    def _load_whole(self, file: str, path: str) -> _Opened:
        for other in [f for f, o in self._opened.items() if o.whole is not None]:
            del self._opened[other]  # a whole shard in memory: never two at once
        try:
            state = torch.load(path, map_location="cpu", weights_only=self._weights_only, mmap=False)
        except Exception as e:  # noqa: BLE001 - torch's zoo of types, as in read_header
            raise CorruptCheckpointError(f"{path}: torch.load could not read it while loading ({type(e).__name__}: {e}). "
                                         "It changed since the load was planned, or is corrupt: copy it again.") from e
        size = os.path.getsize(path)
        self._stats.staged(size)
        self._stats.notes.append(
            f"{path} is a legacy (non-zip) torch pickle: it was loaded whole, costing {size} bytes "
            "of host memory at once. Re-save it with torch.save (torch>=1.6) or as safetensors to stream it."
            if not zipfile.is_zipfile(path) else
            f"{path} pickles more than plain tensors: it was loaded whole by torch.load, costing {size} bytes of host "
            "memory at once. Re-save model.state_dict() with torch.save or as safetensors to stream it."
        )
        return _Opened(whole=state)

    def _located(self, info: TensorInfo) -> tuple[_Opened, StoredTensor | None]:
        """The shard as opened and where ``info``'s tensor is in it, checked against the plan."""
        opened = self._open(info.file)
        found = opened.whole.get(info.key) if opened.whole is not None else opened.stored.get(info.key)
        if found is None or found.dtype != info.dtype or tuple(found.shape) != info.shape:
            now = "no longer holds it" if found is None else f"now holds {found.dtype} {list(found.shape)}"
            raise CorruptCheckpointError(
                f"{info.file} changed since the load was planned: tensor {info.key!r} was {info.dtype} {list(info.shape)}, "
                f"the file {now}. Do not rewrite a checkpoint while it loads; load it again."
            )
        return opened, (None if opened.whole is not None else found)

    def _raw(self, info: TensorInfo, opened: _Opened, where: StoredTensor) -> TensorInfo | None:
        offset = _raw_offset(where, opened.archive, opened.byte_order)
        return replace(info, offset=offset) if offset is not None else None

    def hint(self, info: TensorInfo, shard: ShardSpec | None) -> None:
        opened, where = self._located(info)
        raw = self._raw(info, opened, where) if where is not None else None
        if raw is not None:
            super().hint(raw, shard)

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        opened, where = self._located(info)
        if where is None:  # loaded whole
            src = slice_tensor(opened.whole[info.key], shard)
            return [lambda: dst.copy_(src)]
        raw = self._raw(info, opened, where)
        if raw is not None:
            return super().jobs(raw, dst, shard)
        return [lambda: self._gathered(info, opened, where, dst, shard)] if element_runs(info.shape, shard) else []

    def _gathered(self, info: TensorInfo, opened: _Opened, where: StoredTensor, dst: torch.Tensor, shard: ShardSpec | None) -> None:
        """A tensor stored with other strides or byte order: read the span of its storage it covers, copy it strided."""
        first, last = where.span
        itemsize = where.dtype.itemsize
        buf = torch.empty((last - first + 1) * itemsize, dtype=torch.uint8)
        self._stats.staged(buf.numel())
        member = opened.archive.members[f"data/{where.storage}"]
        self._source.read(info.file, byte_view(buf), member.data_offset + first * itemsize)
        if opened.byte_order != sys.byteorder:
            buf.untyped_storage().byteswap(where.dtype)
        stored = buf.view(where.dtype).as_strided(where.shape, where.stride)
        dst.copy_(slice_tensor(stored, shard))

    def finished(self, file: str) -> None:
        """After the shard's last read: its central directory (every member's CRC and size) must be what it was
        when the first was read, or the file was rewritten under the load and the tensors may mix two files."""
        opened = self._opened.pop(file, None)
        if opened is None or opened.archive is None:
            return
        start, end = opened.archive.directory
        now = bytearray(end - start)
        try:
            self._source.read(file, memoryview(now), start)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{file} was cut while it loaded ({e}). Do not rewrite a checkpoint while it loads; load it again.") from e
        if bytes(now) != opened.directory:
            raise CorruptCheckpointError(
                f"{file} changed while it loaded: its zip directory (the size and CRC of every tensor) is not what it was "
                "when its first tensor was read. Do not rewrite a checkpoint while it loads; load it again."
            )

    def close(self) -> None:
        super().close()
        self._opened.clear()


def open_reader(checkpoint: Checkpoint, plan: LoadPlan, source: ByteSource, *, chunk_bytes: int, weights_only: bool, mmap: bool, stats: StreamStats) -> Reader:
    """The reader of a ``.bin`` checkpoint (``mmap=True`` was refused for it before the stream began)."""
    return TorchReader(plan.reads_per_file(), chunk_bytes, weights_only, stats, source)


def staging_bytes(plan: LoadPlan, checkpoint: Checkpoint, *, workers: int, per_worker: int, converted: bool) -> int:
    """Host bytes the reader holds beyond the destinations. zip: a chunk per reader thread where a dtype changes
    (the same dtype lands in place), plus the largest tensor stored with other strides (read as its span). Legacy
    pickle: its largest shard (loaded whole, one shard at a time)."""
    if checkpoint.format == CheckpointFormat.TORCH_ZIP:
        gathered = max((r.source.nbytes for r in plan.reads if r.source.offset is None), default=0)
        return (workers * per_worker if converted else 0) + gathered
    sizes = Counter()
    for info in checkpoint.tensors.values():
        sizes[info.file] += info.nbytes
    return max((sizes[f] for f in plan.files), default=0)
