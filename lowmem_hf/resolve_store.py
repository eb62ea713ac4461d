"""Resolve an object-store checkpoint (``s3://bucket/prefix``, any fsspec URL whose filesystem reads ranges): the
objects under the prefix pinned once, the small files mirrored locally, and every safetensors header read by ranges.

The prefix resolves like a local folder: ``config.json``, the index, the variants and ``subfolder`` as
transformers chooses them (``resolve.weight_candidates``). What each kind of weight file costs:

- safetensors: each header is read with a range request from byte 0; the tensor bytes are read later, by ranges,
  only those the plan needs (``sources.objectstore``): the ``Checkpoint``'s ``remote`` objects;
- DCP directories (``.metadata`` + ``*.distcp``, as ``FsspecWriter`` writes them): the metadata is mirrored, and
  each rank reads by ranges the chunks of the ``.distcp`` objects its plan needs;
- ``.bin`` shards have no readable header, and transformers' sharded saves (``shard-*.safetensors``) are read
  whole: they are downloaded into the local mirror (conditional on their ETags) and resolve as a local folder there.

One consistent checkpoint: the listing (each object's size, ETag and VersionId) is taken once, by rank 0 under a
process group, and every read after it is conditional on it. The small files (config, generation config, index,
tokenizer, remote code: everything but weights) go into a folder of the store cache named after the URL and their
ETags, so a later load of the same objects reuses it. Containment: every object a load reads is a key under the
prefix; an index entry or ``transformers_weights`` that climbs out (``..``, absolute) is refused before any read.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .distributed.group import current_group, from_rank_zero, is_rank_zero, world_size
from .errors import CheckpointNotFoundError, MissingShardError, OutsideCheckpointError
from .formats import dcp, safetensors
from .resolve import add_tensors, check_index_keys, inside_folder, is_index, parse_index, resolve_dcp, resolve_local, weight_candidates
from .settings import store_cache_dir
from .sources.objectstore import ObjectStore
from .types import Checkpoint, CheckpointFormat, RemoteFile

__all__ = ["is_store_url", "PinnedStore", "pin_store", "resolve_store", "fetch_small_files", "WEIGHT_SUFFIXES"]

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".distcp", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".pkl")
"""Objects that are weights, not small files: never mirrored as such, never fetched by ``fetch_small_files``."""
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_store_url(path: Any) -> bool:
    """Whether ``path`` names an object store (``s3://...``, ``gs://...``, ``memory://...``), not a local folder or a
    Hub repo id (``file://`` is a local folder)."""
    return isinstance(path, str) and _URL.match(path) is not None and not path.startswith("file://")


@dataclass(frozen=True)
class PinnedStore:
    """An object-store checkpoint as listed once: what every later step reads, and the local mirror of its small files."""

    store: ObjectStore
    objects: Mapping[str, RemoteFile]
    """Every object under the prefix by its path under it, pinned to its size, ETag and VersionId."""
    subfolder: str
    """The folder under the prefix that holds config and weights ('' for the prefix itself)."""
    mirror: str
    """The local folder holding the small files, laid out as under the prefix (transformers reads the config there)."""

    def path(self, name: str) -> str:
        return f"{self.subfolder}/{name}" if self.subfolder else name

    def level(self) -> list[str]:
        """The names of the objects directly in the subfolder."""
        return sorted(n for n in self.objects if posixpath.dirname(n) == self.subfolder)


def _is_weight(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def _leaves_prefix(name: str) -> bool:
    return name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/")


def _listing(store: ObjectStore) -> Mapping[str, RemoteFile]:
    """The store's listing; under a process group rank 0's, so that every rank plans with the same ETags."""
    group = current_group()
    if group is None or (world_size() or 1) <= 1:
        return store.list()
    listing, error = None, None
    if is_rank_zero():
        try:
            listing = store.list()
        except Exception as e:  # re-raised below, after the other ranks have been told
            error = e
    chosen = from_rank_zero(listing, group)
    if error is not None:
        raise error
    if chosen is None:
        raise CheckpointNotFoundError(f"Rank 0 could not list {store.url}; see its error.", file=store.url)
    return chosen


def _mirror(store: ObjectStore, objects: Mapping[str, RemoteFile], names: list[str], root: str) -> None:
    """Download ``names`` into ``root`` (each inside it, written aside then renamed); files there already are kept."""
    def one(name: str) -> None:
        path = inside_folder(name, root, what=f"The object {store.url_of(name)} is")
        if not (os.path.isfile(path) and os.path.getsize(path) == objects[name].size):
            store.download(objects[name], path)

    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="lowmem-store") as pool:
        list(pool.map(one, names))


def pin_store(url: str, *, storage_options: Mapping[str, Any] | None, subfolder: str, need_config: bool) -> PinnedStore:
    """List the objects under ``url`` once and mirror the small files of ``subfolder`` into the store cache.

    Raises:
        ImportError: fsspec (or the protocol's filesystem package) is not installed.
        CheckpointNotFoundError: no object under the prefix, or no ``config.json`` (with ``need_config``).
        OutsideCheckpointError: a ``subfolder`` that leaves the prefix.
        ObjectStoreCredentialsError, ObjectStoreError: the store refused or kept failing.
    """
    subfolder = subfolder.strip("/")
    if _leaves_prefix(subfolder):
        raise OutsideCheckpointError(
            f"subfolder={subfolder!r} leaves the prefix {url}: pass a folder under it (no '..').", key="subfolder", file=subfolder,
        )
    store = ObjectStore(url, storage_options)
    objects = _listing(store)
    pinned = PinnedStore(store=store, objects=objects, subfolder=subfolder, mirror="")
    small = [n for n in pinned.level() if not _is_weight(n)]
    if need_config and pinned.path("config.json") not in objects:
        raise CheckpointNotFoundError(
            f"{store.url_of(pinned.path('config.json'))} does not exist. lowmem_hf loads a prefix holding a checkpoint "
            "saved with save_pretrained (config.json plus weights); check the URL and `subfolder`, or pass config=.",
            file=store.url_of(pinned.path("config.json")),
        )
    # named after every object of the subfolder, weights too: a .bin shard downloaded here is never one replaced since
    key = "\n".join([store.url, *(f"{n} {objects[n].etag} {objects[n].version}" for n in pinned.level())])
    mirror = os.path.join(store_cache_dir(), hashlib.sha256(key.encode()).hexdigest()[:24])
    os.makedirs(os.path.join(mirror, subfolder), exist_ok=True)  # there even with no small file (config= passed)
    _mirror(store, objects, small, mirror)
    return replace(pinned, mirror=mirror)


def fetch_small_files(url: str, local_dir: str, *, storage_options: Mapping[str, Any] | None = None) -> str:
    """Download every object under ``url`` that is not weights (config, tokenizer, generation config, remote code,
    in every subfolder) into ``local_dir``, keeping the layout; returns ``local_dir``.

    What a script needs beside the model: ``AutoTokenizer.from_pretrained(local_dir)`` while the weights load from
    the store (``from_pretrained("s3://...")``). Each object is read conditional on the ETag it was listed with.

    Example::

        tokenizer = AutoTokenizer.from_pretrained(lowmem_hf.fetch_small_files("s3://bucket/llama", "/tmp/llama"))

    Raises:
        CheckpointNotFoundError: no object under the prefix.
        ObjectStoreCredentialsError, ObjectStoreError: the store refused or kept failing.
    """
    store = ObjectStore(url, storage_options)
    objects = store.list()
    _mirror(store, objects, [n for n in objects if not _is_weight(n)], os.fspath(local_dir))
    return os.fspath(local_dir)


def resolve_store(
    pinned: PinnedStore, *, variant: str | None, use_safetensors: bool | None, explicit_filename: str | None,
    weights_only: bool, checkpoint_format: str | None,
) -> Checkpoint:
    """The ``Checkpoint`` of a pinned store: safetensors as remote objects (headers by ranges), ``.bin`` and DCP
    downloaded into the mirror and resolved there (see the module doc).

    Raises:
        CheckpointNotFoundError: no weight file of an accepted kind under the prefix.
        MissingShardError: an index names a shard the prefix does not hold.
        OutsideCheckpointError: an index entry or ``transformers_weights`` that leaves the prefix.
        RemoteFileChangedError: an object replaced since it was listed.
    """
    level = pinned.level()
    if (checkpoint_format == "dcp" or _is_dcp(level, pinned.subfolder)) and any(n.endswith(dcp.DISTCP_SUFFIX) for n in level):
        return _distcp_by_ranges(pinned, level)
    if checkpoint_format == "dcp" or _is_dcp(level, pinned.subfolder):  # transformers' sharded save: read whole
        files = [n for n in level if n.endswith((dcp.DCP_METADATA, dcp.DISTCP_SUFFIX)) or dcp.HF_SHARD_PATTERN.match(posixpath.basename(n))]
        _mirror(pinned.store, pinned.objects, files, pinned.mirror)
        return _from_mirror(pinned, resolve_dcp(pinned.mirror, subfolder=pinned.subfolder))
    candidates = weight_candidates(variant=variant, use_safetensors=use_safetensors, explicit_filename=explicit_filename)
    for candidate in candidates:
        _check_inside(pinned, candidate, what="config.json's transformers_weights names" if explicit_filename else "The weight file is")
    found = next((c for c in candidates if pinned.path(c) in pinned.objects), None)
    if found is None:
        raise CheckpointNotFoundError(
            f"No weights under {pinned.store.url_of(pinned.subfolder) if pinned.subfolder else pinned.store.url}: "
            f"looked for {', '.join(candidates)}. Check `variant`, `subfolder` and `use_safetensors`.",
        )
    shard_keys, index_metadata, names = {}, None, [pinned.path(found)]
    if is_index(found):
        shard_keys, index_metadata = parse_index(inside_folder(pinned.path(found), pinned.mirror, what="The index is"))
        names = [_shard(pinned, found, shard, keys) for shard, keys in sorted(shard_keys.items())]
    if not names[0].endswith(".safetensors"):  # .bin: no readable header, read whole as transformers does
        _mirror(pinned.store, pinned.objects, names, pinned.mirror)
        return _from_mirror(pinned, resolve_local(
            pinned.mirror, subfolder=pinned.subfolder, variant=variant, use_safetensors=use_safetensors,
            explicit_filename=explicit_filename, weights_only=weights_only,
        ))
    by_name = {pinned.path(s): keys for s, keys in shard_keys.items()}
    with ThreadPoolExecutor(max_workers=min(8, len(names)), thread_name_prefix="lowmem-headers") as pool:
        headers = list(pool.map(lambda n: _header(pinned, n, by_name.get(n, ())), names))
    tensors, header_bytes = {}, 0
    for infos, nbytes in headers:
        header_bytes += nbytes
        add_tensors(tensors, infos.values())
    if index_metadata is not None:
        check_index_keys(pinned.store.url_of(pinned.path(found)), {pinned.path(s): k for s, k in shard_keys.items()}, tensors)
    return Checkpoint(
        name_or_path=pinned.store.url, format=CheckpointFormat.SAFETENSORS, files=tuple(names), tensors=tensors,
        index_metadata=index_metadata, header_bytes=header_bytes, remote={n: pinned.objects[n] for n in names},
        store=pinned.store, config_dir=pinned.mirror,
    )


def _distcp_by_ranges(pinned: PinnedStore, level: list[str]) -> Checkpoint:
    """A DCP directory (``.metadata`` + ``*.distcp``) whose chunks are read by ranges from the store.

    DCP's metadata says which byte range of which ``.distcp`` file holds each chunk; ``resolve_dcp`` reads it and
    checks every range against its file's size. It runs on a folder of its own holding the metadata (mirrored) and,
    for each ``.distcp`` object, a sparse file of the object's size (no disk, never read: the load reads the
    ``remote`` objects through the store), removed once the layout is read. The checkpoint then names each
    ``.distcp`` file by its object's name (``_named_by_objects``), the same on every rank.
    """
    layout_dir = tempfile.mkdtemp(prefix="lowmem-dcp-layout-")
    names = {}
    try:
        metadata = inside_folder(pinned.path(dcp.DCP_METADATA), pinned.mirror, what="The DCP metadata is")
        shutil.copyfile(metadata, os.path.join(layout_dir, dcp.DCP_METADATA))
        for name in (n for n in level if n.endswith(dcp.DISTCP_SUFFIX)):
            path = os.path.join(layout_dir, posixpath.basename(name))
            with open(path, "wb") as f:
                f.truncate(pinned.objects[name].size)
            names[path] = name
        checkpoint = _named_by_objects(resolve_dcp(layout_dir), names)
    finally:
        shutil.rmtree(layout_dir, ignore_errors=True)
    return replace(
        checkpoint, name_or_path=pinned.store.url, remote={name: pinned.objects[name] for name in names.values()},
        store=pinned.store, config_dir=pinned.mirror,
    )


def _named_by_objects(checkpoint: Checkpoint, names: Mapping[str, str]) -> Checkpoint:
    """``checkpoint`` with every file of its layout folder (a temporary path, another on every rank) named by its
    object instead: under a process group the cooperative fetch schedules byte runs of files by name across the
    ranks, and errors name the object. The local files' identities go: the objects are pinned by their ETags."""
    def named(path: str) -> str:
        return names.get(path, path)

    chunks = {key: tuple(replace(c, file=named(c.file)) for c in stored) for key, stored in checkpoint.layout.chunks.items()}
    return replace(
        checkpoint, files=tuple(named(f) for f in checkpoint.files), layout=replace(checkpoint.layout, chunks=chunks),
        tensors={key: replace(info, file=named(info.file)) for key, info in checkpoint.tensors.items()}, identities={},
    )


def _is_dcp(level: list[str], subfolder: str) -> bool:
    base = {posixpath.basename(n) for n in level}
    if dcp.DCP_METADATA in base and any(n.endswith(dcp.DISTCP_SUFFIX) for n in base):
        return True
    return any(dcp.HF_SHARD_PATTERN.match(n) for n in base) and not {"model.safetensors", "model.safetensors.index.json"} & base


def _from_mirror(pinned: PinnedStore, checkpoint: Checkpoint) -> Checkpoint:
    """A checkpoint resolved in the mirror, named by its URL."""
    return replace(checkpoint, name_or_path=pinned.store.url, config_dir=pinned.mirror)


def _check_inside(pinned: PinnedStore, name: str, *, what: str) -> None:
    if _leaves_prefix(name):
        raise OutsideCheckpointError(
            f"{what} {name!r}, which leaves the prefix {pinned.store.url}: lowmem_hf reads only objects under the "
            "prefix it was given (no '..', not absolute).", file=name,
        )


def _shard(pinned: PinnedStore, index: str, shard: str, keys: list[str]) -> str:
    """The object path of an index entry, checked to stay under the prefix and to exist."""
    _check_inside(pinned, shard, what=f"{index} maps {len(keys)} tensor(s) to")
    name = posixpath.normpath(posixpath.join(posixpath.dirname(pinned.path(index)), shard))
    if name not in pinned.objects:
        raise MissingShardError(
            f"{pinned.store.url_of(pinned.path(index))} names shard {shard!r}, which is not under {pinned.store.url}. "
            f"It should hold {len(keys)} tensors. Copy the missing object, or re-save the checkpoint.", file=shard,
        )
    return name


def _header(pinned: PinnedStore, name: str, keys) -> tuple[dict, int]:
    """A safetensors object's header by range reads from byte 0: one request where the index's keys estimate its size."""
    remote = pinned.objects[name]
    first = 8 + sum(len(k) + 112 for k in keys) + 512 if keys else 64 * 1024
    infos, nbytes = safetensors.read_header_by_ranges(
        lambda start, stop: pinned.store.read_range(remote, start, stop), size=remote.size, name=name, first_bytes=first,
    )
    return {k: replace(info, file=name) for k, info in infos.items()}, nbytes
