"""Resolve: a local folder -> a ``Checkpoint`` (which files, which tensors, where), from headers only.

The weight-file preference mirrors transformers 5's ``_get_resolved_checkpoint_files`` for local folders:
``config.transformers_weights`` if set, then ``model.safetensors``, ``model.safetensors.index.json``,
``pytorch_model.bin``, ``pytorch_model.bin.index.json`` (each with the variant inserted before the extension).
A sharded training checkpoint's folder resolves through its own metadata (``resolve_dcp``). Each format's
header is its module's business (``formats/``).

Containment: every file a load opens lies inside the checkpoint folder, symlinks followed (``inside_folder``,
``check_real_path``), so a ``config.transformers_weights`` or an index entry can never make a load read a file the
caller did not point at. A folder inside the HF cache (a ``snapshot_download`` path) may also resolve into its repo's
blobs, where its snapshot symlinks point.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Sequence

from .errors import CheckpointNotFoundError, CorruptCheckpointError, MissingShardError, OutsideCheckpointError, short_repr
from .formats import dcp, safetensors, torch_pickle
from .types import Checkpoint, CheckpointFormat, TensorInfo, file_identity

__all__ = [
    "resolve_local", "resolve_dcp", "weight_candidates", "is_index", "parse_index", "check_index_keys", "add_tensors",
    "inside_folder", "check_real_path", "cache_roots", "describe_keys", "HOW_TO_LOAD_OUTSIDE",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"


HOW_TO_LOAD_OUTSIDE = (
    "lowmem_hf reads only files inside the checkpoint folder. To load these weights deliberately, copy (or "
    "hard-link) the file into the folder and name it relative to the folder."
)
_CACHE_REPO_FOLDER = re.compile(r"(models|datasets|spaces)--.+")


def _within(path: str, root: str) -> bool:
    """Whether absolute ``path`` is ``root`` or below it (by path components, not string prefix)."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives on Windows
        return False


def inside_folder(entry: str, folder: str, *, what: str, base: str | None = None) -> str:
    """``base/entry`` (``base`` defaults to ``folder``) as an absolute path, refused unless it stays inside
    ``folder`` (``..`` or an absolute path that leaves it). Pure: looks at no file. ``what`` names where the entry
    comes from, for the message.

    Raises:
        OutsideCheckpointError: naming ``what``, the entry, where it leads and the folder.
    """
    folder = os.path.abspath(folder)
    path = os.path.normpath(os.path.join(base or folder, entry))
    if not _within(path, folder):
        raise OutsideCheckpointError(
            f"{what} {entry!r}: that is {path}, outside the checkpoint folder {folder}. {HOW_TO_LOAD_OUTSIDE}",
            file=entry,
        )
    return path


def cache_roots(folder: str) -> tuple[str, ...]:
    """Where a folder laid out as an HF cache snapshot may also resolve to.

    ``.../models--org--name/snapshots/<rev>/...`` holds symlinks into ``.../models--org--name/blobs`` (which may link
    on into the cache's shared blob store, ``<cache>/blobs``). A snapshot folder kept beside its own ``blobs`` folder
    (``<repo>/<snapshot>/file -> <repo>/blobs/...``, the same layout one level flatter, as tools that copy a cache
    repo write it) resolves there too: transformers loads both, and only a ``blobs`` folder next to the checkpoint
    folder is accepted, nothing else outside it."""
    roots = []
    for candidate in dict.fromkeys((os.path.abspath(folder), os.path.realpath(folder))):
        sibling = os.path.join(os.path.dirname(candidate), "blobs")
        if os.path.isdir(sibling):
            roots.append(sibling)
        parts = candidate.split(os.sep)
        for i in range(len(parts) - 2, 0, -1):
            if parts[i] == "snapshots" and _CACHE_REPO_FOLDER.fullmatch(parts[i - 1]):
                repo_folder = os.sep.join(parts[:i]) or os.sep
                roots += [repo_folder, os.path.join(os.path.dirname(repo_folder), "blobs")]
                break
    return tuple(dict.fromkeys(roots))


def check_real_path(path: str, folder: str, *, what: str, entry: str, roots: Sequence[str] = ()) -> None:
    """Refuse ``path`` (inside ``folder`` by name) if, symlinks followed, it lies outside ``folder`` and ``roots``.

    Looks only at the links (``realpath``), reads no byte of the file.

    Raises:
        OutsideCheckpointError: naming ``what``, the entry, the file the link leads to and the folder.
    """
    real = os.path.realpath(path)
    allowed = [os.path.realpath(folder), *(os.path.realpath(r) for r in roots)]
    if not any(_within(real, r) for r in allowed):
        raise OutsideCheckpointError(
            f"{what} {entry!r}: a symlink to {real}, outside the checkpoint folder {os.path.abspath(folder)}. "
            f"{HOW_TO_LOAD_OUTSIDE}",
            file=entry,
        )


def _contained(entry: str, folder: str, *, what: str, base: str | None = None) -> str:
    """``inside_folder`` then, if the file is there, ``check_real_path`` (a cache snapshot may link to its blobs)."""
    path = inside_folder(entry, folder, what=what, base=base)
    if os.path.lexists(path):
        check_real_path(path, folder, what=what, entry=entry, roots=cache_roots(folder))
    return path


def describe_keys(keys: Sequence[str]) -> str:
    """``'a', 'b', 'c' and 4 more``: the first keys of a list, for messages."""
    return ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


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
        if not isinstance(explicit_filename, str) or not explicit_filename.strip():
            raise ValueError(
                f"config.json's transformers_weights is {short_repr(explicit_filename)}: expected the name of a weight file "
                "inside the checkpoint folder (e.g. 'model.safetensors'). Fix the field, or remove it to load the "
                "usual weight files."
            )
        return [explicit_filename]
    candidates = []
    if use_safetensors is not False:
        candidates += [_add_variant(SAFE_WEIGHTS_NAME, variant), _add_variant(SAFE_WEIGHTS_INDEX_NAME, variant)]
    if not use_safetensors:
        candidates += [_add_variant(WEIGHTS_NAME, variant), _add_variant(WEIGHTS_INDEX_NAME, variant)]
    return candidates


def _weight_file(
    directory: str, what: str, *, variant: str | None, use_safetensors: bool | None, explicit_filename: str | None
) -> str:
    """The first weight file (or index) of the accepted kinds that ``directory`` holds; ``what`` names it in errors."""
    candidates = weight_candidates(variant=variant, use_safetensors=use_safetensors, explicit_filename=explicit_filename)
    paths = {c: inside_folder(c, directory, what=what) for c in candidates}  # before any file is looked at
    found = next((c for c in candidates if os.path.isfile(paths[c])), None)
    if found is None:
        raise CheckpointNotFoundError(
            f"No weights in {directory}: looked for {', '.join(candidates)}. "
            + (
                "Pass use_safetensors=None to also accept .bin files."
                if use_safetensors
                else "Check `variant` and `subfolder`, or save the model with save_pretrained."
            )
        )
    return found


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

    what = "config.json's transformers_weights names" if explicit_filename is not None else "The weight file is"
    found = _weight_file(directory, what, variant=variant, use_safetensors=use_safetensors, explicit_filename=explicit_filename)
    header_bytes = 0
    path = _contained(found, directory, what=what)
    index_metadata: dict[str, Any] | None = None
    by_file: dict[str, list[str]] = {}
    if is_index(found):
        header_bytes += os.path.getsize(path)
        files, index_metadata, by_file = _read_index(path, directory)
    else:
        files = [path]

    is_safetensors = files[0].endswith(".safetensors")
    tensors: dict[str, TensorInfo] = {}
    fmt = CheckpointFormat.SAFETENSORS if is_safetensors else None
    identities = {}
    for file in files:
        identities[file] = file_identity(os.stat(file))  # before the header: a change from here on is caught
        if is_safetensors:
            infos, nbytes = safetensors.read_header(file)
        else:
            infos, nbytes, file_fmt = torch_pickle.read_header(file, weights_only=weights_only)
            # One checkpoint may mix zip and legacy shards in theory; the stricter (legacy) one describes it.
            fmt = file_fmt if fmt in (None, CheckpointFormat.TORCH_ZIP) else fmt
        header_bytes += nbytes
        add_tensors(tensors, infos.values())
    check_index_keys(path, by_file, tensors)
    return Checkpoint(
        name_or_path=str(name_or_path),
        format=fmt,
        files=tuple(files),
        tensors=tensors,
        index_metadata=index_metadata,
        header_bytes=header_bytes,
        identities=identities,
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


def check_index_keys(index_path: str, by_file: dict[str, list[str]], tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the index maps to a shard is stored in one of the shards: an index that promises a tensor no
    shard holds would leave it re-initialized with a warning (transformers' behaviour), a model that is silently
    not the checkpoint's."""
    for shard, keys in sorted(by_file.items()):
        absent = [k for k in keys if k not in tensors]
        if absent:
            raise CorruptCheckpointError(
                f"{index_path} maps {len(absent)} tensor(s) to {shard} that no shard stores: {describe_keys(absent)}. "
                "The index does not describe its shards (a shard replaced or an index edited); re-save the "
                "checkpoint with save_pretrained, or copy the index that came with these shards."
            )


def parse_index(index_path: str) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """``({shard file: [keys]}, metadata)`` of a sharded checkpoint's index JSON."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map: dict[str, str] = index["weight_map"]
        by_file: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            if not isinstance(shard, str) or not shard:
                raise TypeError(f"the entry of {key!r} is {shard!r}, not a file name")
            by_file.setdefault(shard, []).append(key)
        if not by_file:
            raise TypeError("its weight_map is empty: it maps no tensor to a file")
        metadata = index.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise TypeError(f"its 'metadata' is {short_repr(metadata)}, not an object")
    # UnicodeDecodeError: the index is not UTF-8 (JSON must be)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(
            f"{index_path} is not a valid index: expected JSON with a 'weight_map' object ({e}). "
            "Re-save the checkpoint with save_pretrained."
        ) from e
    return by_file, metadata


def _read_index(index_path: str, folder: str) -> tuple[list[str], dict[str, Any], dict[str, list[str]]]:
    by_file, metadata = parse_index(index_path)
    directory = os.path.dirname(index_path)
    # every entry inside the folder before any shard is opened (transformers follows them wherever they lead)
    paths = {
        shard: _contained(shard, folder, base=directory, what=f"{os.path.basename(index_path)} maps {describe_keys(keys)} to")
        for shard, keys in by_file.items()
    }
    missing = [shard for shard in by_file if not os.path.isfile(paths[shard])]
    if missing:
        shard = missing[0]
        keys = by_file[shard]
        shown = describe_keys(keys)
        others = f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""
        raise MissingShardError(
            f"{index_path} names shard {shard!r}, which is not in {directory}{others}. "
            f"It should hold {len(keys)} tensors: {shown}. Copy the missing file, or re-save the checkpoint."
        )
    # Shard names sort in file order (model-00001-of-0000N...), so reads go front to back.
    return [paths[shard] for shard in sorted(by_file)], metadata, by_file


def resolve_dcp(name_or_path: str, *, subfolder: str = "") -> Checkpoint:
    """Read a sharded training checkpoint's metadata into a ``Checkpoint`` (global shapes, chunks; no tensor byte).

    Raises:
        CheckpointNotFoundError: neither format's files are there.
        CorruptCheckpointError: a chunk that lies past the end of its file (a truncated ``.distcp`` or shard).
    """
    directory = os.path.abspath(os.path.join(str(name_or_path), subfolder))
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    for name in names:  # what the reader opens first: the metadata, the shards' headers
        if name == dcp.DCP_METADATA or name.endswith(dcp.DISTCP_SUFFIX) or dcp.HF_SHARD_PATTERN.match(name):
            _contained(name, directory, what="The training checkpoint file is")
    layout, infos, header_bytes = dcp.read_layout(directory)
    files = sorted({c.file for chunks in layout.chunks.values() for c in chunks})
    for file in files:  # the metadata names the files it stores chunks in; each must be inside too
        _contained(os.path.relpath(file, directory), directory, what="The training checkpoint's metadata names")
    return Checkpoint(
        name_or_path=str(name_or_path),
        format=CheckpointFormat.DCP,
        files=tuple(files),
        tensors=infos,
        index_metadata=None,
        header_bytes=header_bytes,
        layout=layout,
    )
