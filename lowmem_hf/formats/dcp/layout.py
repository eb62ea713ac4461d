"""Sharded training checkpoints (torch.distributed.checkpoint): read their layout, read each rank's part.

Two on-disk formats, both written by DCP:

- ``dcp.save(model.state_dict(), checkpoint_id=dir)``: ``.metadata`` (DCP's pickled ``Metadata``) plus
  ``__<rank>_<n>.distcp`` files. Each stored chunk is one ``torch.save`` zip archive at ``_StorageInfo.offset``;
  the tensor's bytes are one uncompressed record inside it.
- transformers' ``save_pretrained(..., distributed_checkpoint=True)`` (and ``lowmem_hf.save_pretrained``'s):
  ``shard-<r>-model-<i>-of-<n>.safetensors`` written by DCP's ``HuggingFaceStorageWriter``; each file holds
  one rank's local chunks, their global offsets in the ``DCP_SHARDING_INFO`` header metadata.

What is DCP's: the metadata (``FileSystemReader.read_metadata``, ``HuggingFaceStorageReader.read_metadata``:
global shapes, dtypes, every chunk's offsets and sizes, which file and byte range holds it). What is ours:
reading only the part of a chunk that overlaps this rank's slice. DCP's ``FileSystemReader.read_data``
``torch.load``s every stored chunk whole before narrowing it, so every TP rank reads (and holds) whole
chunks; the safetensors reader maps whole files. Here each rank reads only the byte runs of the overlap
from its byte source (``LocalFiles``: ``preadv``), straight into its destination, through the same staging as
the Hub-format readers.

Also ours: checking the metadata before any tensor byte is read, with the rules DCP applies to what it saves
(``check_chunks``: every chunk a box inside its tensor, no two sharing an element), every byte range inside its
file and no two overlapping, and every element this rank reads stored (``check_covered``); each ``.distcp`` item is
checked as a ``.bin`` archive is (``zip_archive.read_archive``), and ``shard-*`` files as any safetensors file.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MissingKeyError, broken_rule
from ..runs import box_runs, flat_box_runs, overlap, split_runs, wanted_box
from ..sources import ByteSource
from ..types import Checkpoint, LoadPlan, ShardSpec, TensorInfo
from . import safetensors, torch_pickle, zip_archive
from .base import Reader, SourceFile, Staging, StreamStats, byte_view

__all__ = [
    "StoredChunk",
    "DcpLayout",
    "is_dcp_dir",
    "read_layout",
    "check_chunks",
    "check_covered",
    "check_complete",
    "DcpReader",
    "open_reader",
    "staging_bytes",
]

DCP_METADATA = ".metadata"
DISTCP_SUFFIX = ".distcp"
# transformers' `is_sharded_checkpoint` pattern (transformers/distributed/checkpoint.py)
HF_SHARD_PATTERN = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")
_MAX_IOV = 1024  # IOV_MAX on Linux


@dataclass(frozen=True)
class StoredChunk:
    """One stored piece of a tensor: the box ``[offsets, offsets + sizes)`` of the global tensor, row-major."""

    file: str
    """Absolute path of the file that holds it."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    byte_offset: int
    """safetensors: the first data byte. ``.distcp``: where the chunk's ``torch.save`` archive starts."""
    byte_length: int
    """Bytes of the data (safetensors) or of the whole archive (``.distcp``)."""
    raw: bool
    """``True``: raw row-major bytes at ``byte_offset``. ``False``: a ``torch.save`` archive to look inside."""


@dataclass(frozen=True)
class DcpLayout:
    """Every stored chunk of every tensor of a sharded checkpoint (from DCP's metadata, no tensor byte read)."""

    kind: str
    """``"distcp"`` (``dcp.save`` with DCP's file writer) or ``"hf_sharded"`` (``shard-*`` safetensors)."""
    chunks: Mapping[str, tuple[StoredChunk, ...]]
    """Checkpoint key -> its stored chunks (one for a tensor saved whole, one per writing rank when sharded)."""


# ---------------------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------------------
def is_dcp_dir(directory: str) -> bool:
    """Whether ``directory`` holds a sharded training checkpoint: ``.metadata`` + ``*.distcp``, or transformers'
    ``shard-*-model-*-of-*.safetensors`` (and no Hub-layout weights, which would take precedence)."""
    if not os.path.isdir(directory):
        return False
    names = os.listdir(directory)
    if DCP_METADATA in names and any(n.endswith(DISTCP_SUFFIX) for n in names):
        return True
    hub_layout = {"model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"}
    return any(HF_SHARD_PATTERN.match(n) for n in names) and not hub_layout.intersection(names)


def read_layout(directory: str) -> tuple[DcpLayout, dict[str, TensorInfo], int]:
    """Read a sharded training checkpoint's metadata (global shapes, chunks; no tensor byte).

    Returns:
        ``(layout, {key: TensorInfo}, bytes_read)``.

    Raises:
        CheckpointNotFoundError: neither format's files are there.
        CorruptCheckpointError: a chunk that lies past the end of its file (a truncated ``.distcp`` or shard).
    """
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    if DCP_METADATA in names:
        return _read_distcp(directory)
    if any(HF_SHARD_PATTERN.match(n) for n in names):
        return _read_hf_sharded(directory, [n for n in names if HF_SHARD_PATTERN.match(n)])
    raise CheckpointNotFoundError(
        f"{directory} is not a sharded training checkpoint: expected {DCP_METADATA} plus *{DISTCP_SUFFIX} files "
        "(torch.distributed.checkpoint.save) or shard-XXXXX-model-XXXXX-of-XXXXX.safetensors files "
        "(save_pretrained(..., distributed_checkpoint=True)). Check the path, or drop checkpoint_format='dcp'."
    )


def _tensor_info(key: str, chunks: tuple[StoredChunk, ...], dtype: torch.dtype, shape: tuple[int, ...]) -> TensorInfo:
    # The planner orders reads by file; a tensor spread over several files is filed under its first chunk's.
    return TensorInfo(key=key, file=min(c.file for c in chunks), dtype=dtype, shape=shape, offset=None)


_NEWER_TORCH_HINT = (
    f" (Or it was written by a newer torch: torch 2.15 added fields to this file that torch "
    f"{torch.__version__.split('+')[0]} cannot unpickle. Then load it with the torch that saved it.)"
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 15) else ""
)
"""Said where a ``.metadata`` file does not unpickle: DCP's metadata format is not readable by older torch releases."""


def _read_distcp(directory: str) -> tuple[DcpLayout, dict[str, TensorInfo], int]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    metadata_path = os.path.join(directory, DCP_METADATA)
    try:
        metadata = FileSystemReader(directory).read_metadata()
    except Exception as e:  # pickle raises a zoo of types on a damaged file
        raise CorruptCheckpointError(
            f"{metadata_path}: torch.distributed.checkpoint could not read it ({type(e).__name__}: {e}). "
            f"The checkpoint is incomplete or corrupt: save it again.{_NEWER_TORCH_HINT}"
        ) from e
    sizes: dict[str, int] = {}
    chunks: dict[str, tuple[StoredChunk, ...]] = {}
    infos: dict[str, TensorInfo] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue  # non-tensor state (bytes) has no place in a model
        stored = []
        for chunk in entry.chunks:
            storage = metadata.storage_data.get(MetadataIndex(key, chunk.offsets))
            if storage is None:
                raise broken_rule(
                    metadata_path, f"{key!r} (chunk at {list(chunk.offsets)})", "every chunk stored",
                    "an entry in storage_data saying which file holds it", "none",
                    rulebook="DCP", fix=_RESAVE_DCP, key=key,
                )
            path = os.path.join(directory, storage.relative_path)
            if storage.transform_descriptors:
                raise NotImplementedError(
                    f"{path}: {key!r} is stored through DCP stream transforms {list(storage.transform_descriptors)} "
                    "(e.g. compression), which lowmem_hf cannot read by byte range; save without extensions."
                )
            if path not in sizes:
                sizes[path] = os.path.getsize(path) if os.path.isfile(path) else -1
            subject = f"{key!r} (chunk at {list(chunk.offsets)})"
            if storage.offset < 0 or storage.length <= 0:
                raise broken_rule(
                    metadata_path, subject, "byte range inside its file", f"a non-empty byte range of {path}",
                    f"[{storage.offset}, {storage.offset + storage.length})",
                    rulebook="DCP", fix=_RESAVE_DCP, key=key,
                )
            if storage.offset + storage.length > sizes[path]:
                found = "is missing" if sizes[path] < 0 else f"has {sizes[path]} bytes"
                raise CorruptCheckpointError(
                    f"{path}: {subject} is stored in bytes [{storage.offset}, {storage.offset + storage.length}) but the "
                    f"file {found} (rule 'byte range inside its file'). The file is truncated: copy it again or re-save the checkpoint."
                )
            stored.append(StoredChunk(
                file=path, offsets=tuple(chunk.offsets), sizes=tuple(chunk.sizes), dtype=entry.properties.dtype,
                byte_offset=storage.offset, byte_length=storage.length, raw=False,
            ))
        chunks[key] = tuple(stored)
        check_chunks(key, tuple(entry.size), chunks[key], where=metadata_path)
        infos[key] = _tensor_info(key, chunks[key], entry.properties.dtype, tuple(entry.size))
    _check_byte_ranges(chunks, where=metadata_path)
    return DcpLayout("distcp", chunks), infos, os.path.getsize(metadata_path)


def _read_hf_sharded(directory: str, names: list[str]) -> tuple[DcpLayout, dict[str, TensorInfo], int]:
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    # Our own header parse first: it checks every tensor lies inside its file (naming a truncated shard) and
    # knows the byte offsets, which DCP's reader keeps to itself (it reads through safe_open's mapping).
    offsets: dict[tuple[str, str], TensorInfo] = {}
    header_bytes = 0
    for name in names:
        path = os.path.join(directory, name)
        infos, nbytes = safetensors.read_header(path)
        header_bytes += nbytes
        for key, info in infos.items():
            offsets[(path, key)] = info
    try:
        metadata = HuggingFaceStorageReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - safetensors, json and KeyError on a damaged DCP_SHARDING_INFO
        raise CorruptCheckpointError(
            f"{directory}: torch.distributed.checkpoint could not read the sharded checkpoint's metadata "
            f"({type(e).__name__}: {e}). The checkpoint is incomplete or corrupt: save it again."
        ) from e
    chunks: dict[str, list[StoredChunk]] = {}
    for index, storage in metadata.storage_data.items():
        path = os.path.abspath(storage.relative_path)
        info = offsets[(path, index.fqn)]
        chunks.setdefault(index.fqn, []).append(StoredChunk(
            file=path, offsets=tuple(index.offset), sizes=tuple(storage.shape), dtype=storage.dtype,
            byte_offset=info.offset, byte_length=info.nbytes, raw=True,
        ))
    layout = DcpLayout("hf_sharded", {k: tuple(sorted(v, key=lambda c: c.offsets)) for k, v in chunks.items()})
    for key, entry in metadata.state_dict_metadata.items():
        check_chunks(key, tuple(entry.size), layout.chunks[key], where=directory)
    infos = {
        key: _tensor_info(key, layout.chunks[key], entry.properties.dtype, tuple(entry.size))
        for key, entry in metadata.state_dict_metadata.items()
    }
    return layout, infos, header_bytes


_RESAVE_DCP = "The checkpoint is corrupt: save it again."


def _boxes_overlap(a: StoredChunk, b: StoredChunk) -> bool:
    return all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a.offsets, a.sizes, b.offsets, b.sizes))


def _first_overlap(chunks: tuple[StoredChunk, ...]) -> tuple[StoredChunk, StoredChunk] | None:
    """Two chunks sharing an element, or None: a sweep along the longest dim, as DCP's own save-time check does."""
    filled = [c for c in chunks if math.prod(c.sizes) > 0]
    if len(filled) < 2:
        return None
    if not filled[0].offsets:  # a scalar stored twice
        return filled[0], filled[1]
    dim = max(range(len(filled[0].offsets)), key=lambda d: max(c.offsets[d] + c.sizes[d] for c in filled))
    active: list[StoredChunk] = []
    for chunk in sorted(filled, key=lambda c: c.offsets[dim]):
        active = [a for a in active if a.offsets[dim] + a.sizes[dim] > chunk.offsets[dim]]
        for other in active:
            if _boxes_overlap(chunk, other):
                return other, chunk
        active.append(chunk)
    return None


def check_chunks(key: str, size: tuple[int, ...], chunks: tuple[StoredChunk, ...], *, where: str) -> None:
    """DCP's own rules for what it saves (``default_planner._validate_global_plan``), checked on what is read:
    every chunk a box inside its tensor, no two chunks sharing an element.

    Raises:
        CorruptCheckpointError: naming the key, the rule, what was expected and what was found.
    """
    for c in chunks:
        if len(c.offsets) != len(size) or len(c.sizes) != len(size) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(c.offsets, c.sizes, size)
        ):
            raise broken_rule(
                where, f"{key!r} (chunk at {list(c.offsets)})", "chunk inside its tensor", f"a box inside the tensor's shape {list(size)}",
                f"offsets {list(c.offsets)}, sizes {list(c.sizes)}", rulebook="DCP", fix=_RESAVE_DCP, key=key,
            )
    pair = _first_overlap(chunks)
    if pair is not None:
        a, b = pair
        raise broken_rule(
            where, f"{key!r}", "chunks do not overlap", "chunks that share no element",
            f"chunk at {list(a.offsets)} (sizes {list(a.sizes)}) overlapping chunk at {list(b.offsets)} (sizes {list(b.sizes)})",
            rulebook="DCP", fix=_RESAVE_DCP, key=key,
        )


def _check_byte_ranges(chunks: Mapping[str, tuple[StoredChunk, ...]], *, where: str) -> None:
    """No two stored chunks share a byte of a file (one would read the other's values)."""
    by_file: dict[str, list[tuple[int, int, str, StoredChunk]]] = {}
    for key, stored in chunks.items():
        for c in stored:
            by_file.setdefault(c.file, []).append((c.byte_offset, c.byte_offset + c.byte_length, key, c))
    for file, ranges in by_file.items():
        ranges.sort(key=lambda r: r[:2])
        for (_, prev_end, prev_key, prev), (start, end, key, c) in zip(ranges, ranges[1:]):
            if start < prev_end:
                raise broken_rule(
                    where, f"{key!r} (chunk at {list(c.offsets)})", "byte ranges do not overlap",
                    f"bytes of {file} from {prev_end} on (after {prev_key!r}, chunk at {list(prev.offsets)})",
                    f"[{start}, {end})",
                    rulebook="DCP", fix=_RESAVE_DCP, key=key,
                )


def check_covered(checkpoint: Checkpoint, plan: LoadPlan) -> None:
    """Every element the plan reads is in a stored chunk (chunks do not overlap: ``check_chunks``), before any byte
    is read: a tensor that was not saved whole is an error, not uninitialized memory.

    Raises:
        CorruptCheckpointError: naming the key and how much of what this rank reads is stored.
    """
    reads = [(r.source, r.shard) for r in plan.reads]
    reads += [(info, None) for s in plan.submodules for c in s.conversions for _, info in c.sources]
    for info, shard in reads:
        flat = shard is not None and shard.flat
        start, stop = wanted_box(info.shape, shard)
        needed = shard.stop - shard.start if flat else math.prod(b - a for a, b in zip(start, stop))
        what = f"elements [{shard.start}, {shard.stop}) of the flattened" if flat else f"[{list(start)}, {list(stop)}) of"
        covered = 0
        for chunk in checkpoint.layout.chunks[info.key]:
            if flat:  # a ZeRO-3 partition: a range of the flattened tensor
                covered += sum(n for _, _, n in flat_box_runs(info.shape, chunk.offsets, chunk.sizes, shard.start, shard.stop))
                continue
            box = overlap(chunk.offsets, chunk.sizes, start, stop)
            if box is not None:
                covered += math.prod(h - l for l, h in zip(*box))
        if covered != needed:
            raise broken_rule(
                checkpoint.name_or_path, f"{info.key!r}", "chunks cover what is read",
                f"stored chunks holding the {needed} elements this rank reads ({what} global shape {list(info.shape)})",
                f"{covered} stored (chunks at {[list(c.offsets) for c in checkpoint.layout.chunks[info.key]]}). The checkpoint is incomplete",
                rulebook="DCP", fix=_RESAVE_DCP, key=info.key,
            )


def check_complete(model: Any, plan: LoadPlan, checkpoint: Checkpoint) -> None:
    """A resumed model must come entirely from its checkpoint: a missing key is an error, not a fresh init.

    Tied targets (``lm_head.weight`` tied to the embeddings) are exempt: they are the same tensor as their source.

    Raises:
        MissingKeyError: naming the keys the checkpoint lacks.
    """
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = sorted(k for k in plan.missing_keys if k not in tied)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MissingKeyError(
            f"{checkpoint.name_or_path} lacks {len(missing)} tensor(s) {type(model).__name__} needs: {shown}. "
            f"The checkpoint stores {len(checkpoint.tensors)} tensors; was it saved from this model "
            "(model.state_dict()) and completely? Re-save it, or pass the config it was saved with."
        )


# ---------------------------------------------------------------------------------------------------------
# Read
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Located:
    """Where a chunk's raw row-major bytes start, or the whole tensor when they are not raw."""

    data_offset: int | None
    whole: torch.Tensor | None = None


def _spans(job: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Runs of a job whose source bytes follow each other: one read each (up to ``_MAX_IOV`` buffers)."""
    spans: list[list[tuple[int, int, int]]] = []
    for run in job:
        if spans and len(spans[-1]) < _MAX_IOV and spans[-1][-1][0] + spans[-1][-1][2] == run[0]:
            spans[-1].append(run)
        else:
            spans.append([run])
    return spans


class DcpReader(Reader):
    """The stream contract over a ``DcpLayout``: reads only the overlap of each stored chunk with this rank's
    slice, in byte runs, from ``source`` (local files)."""

    def __init__(self, layout: DcpLayout, chunk_bytes: int, stats: StreamStats, source: ByteSource):
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._stats = stats
        self._source = source
        self._staging = Staging(stats)
        self._located: dict[StoredChunk, _Located] = {}
        self._lock = threading.Lock()
        self._extra = 0  # archive headers read to locate .distcp tensors

    def _count(self, n: int) -> None:
        with self._lock:
            self._extra += n

    def _locate(self, chunk: StoredChunk) -> _Located:
        """A ``.distcp`` item is a ``torch.save`` zip: its tensor bytes are one uncompressed member. Read the
        archive's directory, its pickle and the member's local header (about 1 KiB), each checked as a ``.bin``
        archive is (``zip_archive.read_archive``), to find where they start; a tensor stored with other strides or
        byte order is loaded whole instead (the minimal unit then)."""
        if chunk.raw:
            return _Located(chunk.byte_offset)
        found = self._located.get(chunk)
        if found is not None:
            return found
        where = f"{chunk.file} (the item at bytes [{chunk.byte_offset}, {chunk.byte_offset + chunk.byte_length}))"
        view = SourceFile(self._source, chunk.file, chunk.byte_offset, chunk.byte_length, self._count)
        archive = zip_archive.read_archive(view, name=where)
        tensor = torch_pickle.unpickle_locations(view, archive, name=where)
        if not isinstance(tensor, torch_pickle.StoredTensor):
            raise CorruptCheckpointError(f"{where}: the item is not a torch.save archive of one tensor. The checkpoint is corrupt: save it again.")
        member = torch_pickle.check_in_storage(f"chunk at {list(chunk.offsets)}", tensor, archive, name=where)
        if tensor.shape != chunk.sizes or tensor.dtype != chunk.dtype:
            raise CorruptCheckpointError(
                f"{where}: the item holds a {tensor.dtype} tensor of shape {list(tensor.shape)}, the checkpoint metadata "
                f"says {chunk.dtype} {list(chunk.sizes)}. The checkpoint is corrupt: save it again."
            )
        if tensor.row_major and zip_archive.byte_order(view, archive) == sys.byteorder:
            located = _Located(chunk.byte_offset + member.data_offset + tensor.storage_offset * chunk.dtype.itemsize)
        else:
            whole = torch.load(
                SourceFile(self._source, chunk.file, chunk.byte_offset, chunk.byte_length, self._count), map_location="cpu", weights_only=True
            )
            self._stats.staged(whole.nbytes)
            self._stats.notes.append(f"{chunk.file}: a chunk stored with non-row-major strides was read whole")
            located = _Located(None, whole.contiguous())
        with self._lock:
            self._located[chunk] = located
        return located

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        """Chunk reads that together fill ``dst`` with this rank's part of ``info``'s tensor, from every stored
        chunk that overlaps it. Safe to run on several threads at once."""
        start, stop = wanted_box(info.shape, shard)
        local = tuple(b - a for a, b in zip(start, stop))
        jobs: list[Callable[[], None]] = []
        for chunk in self._layout.chunks[info.key]:
            if shard is not None and shard.flat:  # a ZeRO-3 partition: a range of the flattened tensor
                runs = flat_box_runs(info.shape, chunk.offsets, chunk.sizes, shard.start, shard.stop)
                if not runs:
                    continue
            else:
                box = overlap(chunk.offsets, chunk.sizes, start, stop)
                if box is None:
                    continue
                lo, hi = box
                size = tuple(h - l for l, h in zip(lo, hi))
                runs = box_runs(
                    chunk.sizes, tuple(l - o for l, o in zip(lo, chunk.offsets)), local, tuple(l - s for l, s in zip(lo, start)), size
                )
            self._stats.opened(chunk.file)
            jobs += [functools.partial(self._read, chunk, dst, job) for job in split_runs(runs, chunk.dtype.itemsize, self._chunk_bytes)]
        return jobs

    def _read(self, chunk: StoredChunk, dst: torch.Tensor, job: list[tuple[int, int, int]]) -> None:
        located = self._locate(chunk)
        flat = dst.view(-1)
        if located.whole is not None:
            source = located.whole.reshape(-1)
            for src, at, n in job:
                flat[at : at + n].copy_(source[src : src + n])
            return
        itemsize, source, start = chunk.dtype.itemsize, self._source, located.data_offset
        direct = dst.device.type == "cpu" and dst.dtype == chunk.dtype and dst.is_contiguous()
        for span in _spans(job):
            if direct:  # one contiguous range of the file, scattered into the destination: one call
                view = byte_view(dst)
                source.read_runs(chunk.file, [(view[at * itemsize : (at + n) * itemsize], start + src * itemsize) for src, at, n in span])
                continue
            total = sum(n for _, _, n in span) * itemsize
            buf = self._staging.get(total, pinned=dst.device.type == "cuda")
            source.read(chunk.file, byte_view(buf), start + span[0][0] * itemsize)
            values, pos = buf.view(chunk.dtype), 0
            for _, at, n in span:
                flat[at : at + n].copy_(values[pos : pos + n])
                pos += n

    def done(self, info: TensorInfo, nbytes: int) -> None:
        self._stats.read(nbytes)  # through the progress bar, as every reader

    def close(self) -> None:
        with self._lock:
            self._located.clear()
            self._stats.header_bytes += self._extra
            self._extra = 0


def open_reader(checkpoint: Checkpoint, plan: LoadPlan, source: ByteSource, *, chunk_bytes: int, weights_only: bool, mmap: bool, stats: StreamStats) -> Reader:
    """The reader of a sharded training checkpoint (``checkpoint.layout``). ``.distcp`` items are read as raw bytes;
    the rare chunk stored with other strides is loaded with ``weights_only=True`` whatever ``weights_only`` says."""
    check_covered(checkpoint, plan)
    return DcpReader(checkpoint.layout, chunk_bytes, stats, source)



def staging_bytes(plan: LoadPlan, checkpoint: Checkpoint, *, workers: int, per_worker: int, converted: bool) -> int:
    """Host bytes the reader holds beyond the destinations: as for safetensors (raw bytes, read by ranges)."""
    return safetensors.staging_bytes(plan, checkpoint, workers=workers, per_worker=per_worker, converted=converted)
