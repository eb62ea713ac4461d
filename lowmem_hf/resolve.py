"""Resolve: a local folder -> a ``Checkpoint`` (which files, which tensors, where), from headers only.

The weight-file preference mirrors transformers 5's ``_get_resolved_checkpoint_files`` for local folders:
``config.transformers_weights`` if set, then ``model.safetensors``, ``model.safetensors.index.json``,
``pytorch_model.bin``, ``pytorch_model.bin.index.json`` (each with the variant inserted before the extension).
"""

from __future__ import annotations

import json
import os
import struct
import zipfile
from typing import Any

import torch

from .errors import CheckpointNotFoundError, CorruptCheckpointError, MissingShardError
from .types import Checkpoint, CheckpointFormat, TensorInfo

__all__ = ["resolve_local", "read_safetensors_header", "read_torch_header", "SAFETENSORS_DTYPES"]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

# The safetensors format's dtype tags (its spec, `safetensors/src/tensor.rs` `Dtype`).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}

# A header larger than this is not a safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100_000_000


def _add_variant(name: str, variant: str | None) -> str:
    """The variant before the LAST extension, as transformers' ``save_pretrained`` writes it and its loader
    looks for it: ``model.v2.safetensors``, ``model.safetensors.index.v2.json``, ``pytorch_model.bin.index.v2.json``."""
    if not variant:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def is_index(name: str) -> bool:
    """Whether a weight file name found by ``weight_candidates`` is an index (``model.safetensors.index.v2.json``)."""
    return name.endswith(".json")


def weight_candidates(*, variant: str | None, use_safetensors: bool | None, explicit_filename: str | None) -> list[str]:
    """Weight file names to look for, in transformers' order of preference."""
    if explicit_filename is not None:
        return [explicit_filename]
    candidates = []
    if use_safetensors is not False:
        candidates += [_add_variant(SAFE_WEIGHTS_NAME, variant), _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)]
    if not use_safetensors:
        candidates += [_add_variant(WEIGHTS_NAME, variant), _add_variant(WEIGHTS_INDEX_NAME, variant)]
    return candidates


def resolve_local(
    name_or_path: str,
    *,
    subfolder: str = "",
    variant: str | None = None,
    use_safetensors: bool | None = None,
    explicit_filename: str | None = None,
    weights_only: bool = True,
) -> Checkpoint:
    """Find the weight files of a local folder and read every tensor's header.

    Args:
        name_or_path: a folder saved with ``save_pretrained``.
        subfolder: a folder inside it that holds config and weights.
        variant: e.g. ``"fp16"`` for ``model.fp16.safetensors``.
        use_safetensors: ``True`` only safetensors, ``False`` only ``.bin``, ``None`` safetensors first.
        explicit_filename: ``config.transformers_weights``, when the config names its weights file.
        weights_only: passed to ``torch.load`` for ``.bin`` pickles.

    Returns:
        The resolved ``Checkpoint``.

    Raises:
        CheckpointNotFoundError: no weight file of an accepted kind.
        MissingShardError: an index names a shard that is not there.
        CorruptCheckpointError: a header that does not parse or does not fit its file.
    """
    directory = os.path.abspath(os.path.join(str(name_or_path), subfolder))
    if not os.path.isdir(directory):
        raise CheckpointNotFoundError(
            f"{directory} is not a folder. lowmem_hf loads a local folder saved with save_pretrained "
            "(config.json plus model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
            "pytorch_model.bin.index.json); check the path and `subfolder`."
        )

    candidates = weight_candidates(variant=variant, use_safetensors=use_safetensors, explicit_filename=explicit_filename)
    found = next((c for c in candidates if os.path.isfile(os.path.join(directory, c))), None)
    if found is None:
        raise CheckpointNotFoundError(
            f"No weights in {directory}: looked for {', '.join(candidates)}. "
            + (
                "Pass use_safetensors=None to also accept .bin files."
                if use_safetensors
                else "Check `variant` and `subfolder`, or save the model with save_pretrained."
            )
        )

    header_bytes = 0
    path = os.path.join(directory, found)
    index_metadata: dict[str, Any] | None = None
    if is_index(found):
        header_bytes += os.path.getsize(path)
        files, index_metadata = _read_index(path)
    else:
        files = [path]

    is_safetensors = files[0].endswith(".safetensors")
    tensors: dict[str, TensorInfo] = {}
    fmt = CheckpointFormat.SAFETENSORS if is_safetensors else None
    for file in files:
        if is_safetensors:
            infos, nbytes = read_safetensors_header(file)
        else:
            infos, nbytes, file_fmt = read_torch_header(file, weights_only=weights_only)
            # One checkpoint may mix zip and legacy shards in theory; the stricter (legacy) one describes it.
            fmt = file_fmt if fmt in (None, CheckpointFormat.TORCH_ZIP) else fmt
        header_bytes += nbytes
        add_tensors(tensors, infos.values())
    return Checkpoint(
        name_or_path=str(name_or_path),
        format=fmt,
        files=tuple(files),
        tensors=tensors,
        index_metadata=index_metadata,
        header_bytes=header_bytes,
    )


def add_tensors(tensors: dict[str, TensorInfo], infos) -> None:
    """Merge one file's tensor infos into ``tensors``; a key stored in two files is an error."""
    for info in infos:
        if info.key in tensors:
            raise CorruptCheckpointError(
                f"Tensor {info.key!r} is stored twice: in {tensors[info.key].file} and in {info.file}. "
                "A checkpoint must store each key once; re-save it with save_pretrained."
            )
        tensors[info.key] = info


def parse_index(index_path: str) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """``({shard file: [keys]}, metadata)`` of a sharded checkpoint's index JSON."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map: dict[str, str] = index["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            by_file.setdefault(shard, []).append(key)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{index_path} is not a valid index: expected JSON with a 'weight_map' object ({e}). "
            "Re-save the checkpoint with save_pretrained."
        ) from e
    return by_file, index.get("metadata") or {}


def _read_index(index_path: str) -> tuple[list[str], dict[str, Any]]:
    by_file, metadata = parse_index(index_path)
    directory = os.path.dirname(index_path)
    missing = [shard for shard in by_file if not os.path.isfile(os.path.join(directory, shard))]
    if missing:
        shard = missing[0]
        keys = by_file[shard]
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        others = f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise MissingShardError(
            f"{index_path} names shard {shard!r}, which is not in {directory}{others}. "
            f"It should hold {len(keys)} tensors: {shown}. Copy the missing file, or re-save the checkpoint."
        )
    # Shard names sort in file order (model-00001-of-0000N...), so reads go front to back.
    return [os.path.join(directory, shard) for shard in sorted(by_file)], metadata


def read_safetensors_header(path: str) -> tuple[dict[str, TensorInfo], int]:
    """Parse a local safetensors header and check that every tensor lies inside the file.

    Written by hand because neither safetensors nor huggingface_hub exposes a *local* file's byte
    offsets (safetensors hides them behind ``get_slice``; huggingface_hub parses only remote headers),
    and streaming needs them to ``pread`` straight into the destination.

    Returns:
        ``({key: TensorInfo}, bytes_read)``.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = _header_length(prefix, size, path)
        raw = f.read(header_len)
    return parse_safetensors_header(raw, header_len=header_len, file_size=size, name=path), 8 + header_len


def _header_length(prefix: bytes, size: int, name: str) -> int:
    if len(prefix) < 8:
        raise CorruptCheckpointError(
            f"{name} is {size} bytes, too short for a safetensors file (an 8-byte header length comes first). "
            "The file is truncated: download or copy it again."
        )
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
        raise CorruptCheckpointError(
            f"{name}: the header claims {header_len} bytes but the file has {size - 8} after the length prefix. "
            "The file is truncated or not a safetensors file: download or copy it again."
        )
    return header_len


def parse_safetensors_header(raw: bytes, *, header_len: int, file_size: int, name: str) -> dict[str, TensorInfo]:
    """Tensor infos from a safetensors header's JSON bytes; ``name`` goes into ``TensorInfo.file`` and errors."""
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(
            f"{name}: the safetensors header is not valid JSON ({e}). The file is corrupt: download or copy it again."
        ) from e

    data_start = 8 + header_len
    data_size = file_size - data_start
    infos: dict[str, TensorInfo] = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(
                f"{name}: tensor {key!r} has an unreadable header entry {entry!r} "
                f"(expected dtype among {sorted(SAFETENSORS_DTYPES)}, shape and data_offsets)."
            ) from e
        info = TensorInfo(key=key, file=name, dtype=dtype, shape=shape, offset=data_start + begin)
        if end - begin != info.nbytes or begin < 0:
            raise CorruptCheckpointError(
                f"{name}: tensor {key!r} ({entry['dtype']} {list(shape)}) needs {info.nbytes} bytes "
                f"but its data_offsets [{begin}, {end}) span {end - begin}. The file is corrupt."
            )
        if end > data_size:
            raise CorruptCheckpointError(
                f"{name}: tensor {key!r} ends at byte {data_start + end} but the file has {file_size} bytes. "
                "The file is truncated: download or copy it again."
            )
        infos[key] = info
    return infos


def read_torch_header(path: str, *, weights_only: bool) -> tuple[dict[str, TensorInfo], int, str]:
    """Shapes and dtypes of a ``torch.save`` file without reading tensor data.

    A zip archive is unpickled onto ``meta`` (torch reads only ``data.pkl``); a legacy pickle
    stream interleaves data and pickle, so learning its shapes reads the whole file once.

    Returns:
        ``({key: TensorInfo}, bytes_read, CheckpointFormat)``.
    """
    is_zip = zipfile.is_zipfile(path)
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
    if is_zip:
        with zipfile.ZipFile(path) as z:
            pkl = next((i for i in z.infolist() if i.filename.endswith("data.pkl")), None)
            nbytes = pkl.file_size if pkl is not None else 0
    else:
        nbytes = os.path.getsize(path)
    infos = {
        k: TensorInfo(key=k, file=path, dtype=v.dtype, shape=tuple(v.shape), offset=None) for k, v in state.items()
    }
    return infos, nbytes, CheckpointFormat.TORCH_ZIP if is_zip else CheckpointFormat.TORCH_LEGACY
