"""A sharded training checkpoint's layout: DCP's metadata (``.metadata``, or the ``DCP_SHARDING_INFO`` of
``shard-*`` safetensors files) read into a ``DcpLayout``, no tensor byte read, and checked with the rules DCP
applies to what it saves (``check_chunks``) and every byte range inside its file, no two overlapping.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from ...errors import CheckpointNotFoundError, CorruptCheckpointError, broken_rule
from ...types import TensorInfo
from .. import safetensors

DCP_METADATA = ".metadata"
DISTCP_SUFFIX = ".distcp"
# transformers' `is_sharded_checkpoint` pattern (transformers/distributed/checkpoint.py)
HF_SHARD_PATTERN = re.compile(r"^shard-[0-9]{5}-model-[0-9]{5}-of-[0-9]{5}\.safetensors$")
RESAVE_DCP = "The checkpoint is corrupt: save it again."
"""The fix a broken rule of DCP's metadata names."""


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
                    rulebook="DCP", fix=RESAVE_DCP, key=key,
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
                    rulebook="DCP", fix=RESAVE_DCP, key=key,
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
                f"offsets {list(c.offsets)}, sizes {list(c.sizes)}", rulebook="DCP", fix=RESAVE_DCP, key=key,
            )
    pair = _first_overlap(chunks)
    if pair is not None:
        a, b = pair
        raise broken_rule(
            where, f"{key!r}", "chunks do not overlap", "chunks that share no element",
            f"chunk at {list(a.offsets)} (sizes {list(a.sizes)}) overlapping chunk at {list(b.offsets)} (sizes {list(b.sizes)})",
            rulebook="DCP", fix=RESAVE_DCP, key=key,
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
                    rulebook="DCP", fix=RESAVE_DCP, key=key,
                )
