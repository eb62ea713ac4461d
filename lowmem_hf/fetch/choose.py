"""The byte source of a load, chosen from a table: where the checkpoint is x the fetch mode x the process group.

Where the checkpoint is (``checkpoint_kind``):

- ``"local"``: files on this machine (a folder, a training checkpoint);
- ``"hub"``: a Hub repo whose planned files are read from the HF cache (``.bin`` shards, a checkpoint already
  cached, or any Hub checkpoint offline): the files missing from the cache are downloaded first;
- ``"hub-ranges"``: a Hub safetensors checkpoint with files not in the cache, whose bytes can be read over HTTP;
- ``"store-ranges"``: a safetensors checkpoint in object storage (``s3://...``, any fsspec store);
- ``"store-chunks"``: a DCP checkpoint (``.distcp``) in object storage, whose chunks are read by ranges.

``"hub-ranges"`` under ``fetch="ranges"``, and ``"store-ranges"`` and ``"store-chunks"`` under either mode, read
tensor bytes into memory without a local file (an object store has no cache to download into: its ``.bin`` files
are downloaded at resolve and are ``"local"``); under a process group the ranks then fetch together (each byte
once, ``sources.exchange``; a DCP checkpoint's chunks are located first, ``formats.dcp.CooperativeChunks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..distributed.group import current_group, world_size
from ..formats.dcp import CooperativeChunks
from ..sources import ByteSource
from ..sources.exchange import CooperativeRanges
from ..sources.http import HttpRanges
from ..sources.local import LocalFiles
from ..sources.objectstore import ObjectStoreRanges
from ..types import Checkpoint, CheckpointFormat, LoadPlan
from . import fetch_files

__all__ = ["FetchOptions", "SOURCES", "checkpoint_kind", "reads_local_files", "in_process_group", "open_source"]


@dataclass(frozen=True)
class FetchOptions:
    """What a byte source is told when it is made; each takes what it needs."""

    fetch: str
    """``"files"`` or ``"ranges"`` (``from_pretrained(fetch=...)``)."""
    cold: bool
    """The local files are mostly not in the page cache (a local source then reads through no gap)."""
    hub: dict[str, Any]
    """huggingface_hub's arguments (token, cache_dir, ...)."""
    verify: bool
    """Hash the LFS files downloaded here against their sha256."""
    tqdm_class: Any
    """huggingface_hub's progress bar class for downloads."""
    span_bytes: int
    """The cooperative fetch's span size."""
    synchronous: bool
    """Start no thread (``HF_DEACTIVATE_ASYNC_LOAD``)."""


def _local_files(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    return LocalFiles.for_load(checkpoint.local_paths, cold=told.cold, planned=checkpoint.identities)


def _downloaded_files(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    paths = fetch_files(checkpoint, plan.files, told.hub, verify=told.verify, tqdm_class=told.tqdm_class)
    return LocalFiles.for_load(paths, cold=told.cold, planned=checkpoint.identities)


def _http_ranges(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    return HttpRanges(checkpoint.remote, token=told.hub.get("token"), local=checkpoint.local_paths)


def _cooperative_ranges(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    return CooperativeRanges(
        checkpoint.remote, plan, token=told.hub.get("token"), local=checkpoint.local_paths,
        span_bytes=told.span_bytes, synchronous=told.synchronous,
    )


def _store_ranges(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    return ObjectStoreRanges(checkpoint.remote, checkpoint.store)


def _cooperative_store_ranges(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    return CooperativeRanges(
        checkpoint.remote, plan, ranges=ObjectStoreRanges(checkpoint.remote, checkpoint.store),
        span_bytes=told.span_bytes, synchronous=told.synchronous,
    )


def _cooperative_store_chunks(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    return CooperativeChunks(
        checkpoint, plan, ObjectStoreRanges(checkpoint.remote, checkpoint.store),
        span_bytes=told.span_bytes, synchronous=told.synchronous,
    )


SOURCES: dict[tuple[str, str, bool], Callable[[Checkpoint, LoadPlan, FetchOptions], ByteSource]] = {
    # (where the checkpoint is, fetch mode, under a process group): the byte source
    ("local", "files", False): _local_files,
    ("local", "files", True): _local_files,
    ("local", "ranges", False): _local_files,
    ("local", "ranges", True): _local_files,
    ("hub", "files", False): _downloaded_files,
    ("hub", "files", True): _downloaded_files,
    ("hub", "ranges", False): _downloaded_files,
    ("hub", "ranges", True): _downloaded_files,
    ("hub-ranges", "files", False): _downloaded_files,
    ("hub-ranges", "files", True): _downloaded_files,
    ("hub-ranges", "ranges", False): _http_ranges,
    ("hub-ranges", "ranges", True): _cooperative_ranges,
    ("store-ranges", "files", False): _store_ranges,
    ("store-ranges", "files", True): _cooperative_store_ranges,
    ("store-ranges", "ranges", False): _store_ranges,
    ("store-ranges", "ranges", True): _cooperative_store_ranges,
    ("store-chunks", "files", False): _store_ranges,
    ("store-chunks", "files", True): _cooperative_store_chunks,
    ("store-chunks", "ranges", False): _store_ranges,
    ("store-chunks", "ranges", True): _cooperative_store_chunks,
}
_LOCAL = (_local_files, _downloaded_files)


def checkpoint_kind(checkpoint: Checkpoint) -> str:
    """Where the checkpoint's bytes are: ``"local"``, ``"hub"``, ``"hub-ranges"``, ``"store-ranges"`` or
    ``"store-chunks"`` (see the module doc)."""
    if checkpoint.store is not None and checkpoint.remote:
        return "store-chunks" if checkpoint.format == CheckpointFormat.DCP else "store-ranges"
    if checkpoint.remote and checkpoint.format == CheckpointFormat.SAFETENSORS:
        return "hub-ranges"
    return "hub" if checkpoint.repo_id is not None else "local"


def in_process_group() -> bool:
    """Whether this process is one of several ranks of a process group."""
    return current_group() is not None and (world_size() or 1) > 1


def reads_local_files(checkpoint: Checkpoint, fetch: str) -> bool:
    """Whether the tensor bytes are read from local files; False when they come over HTTP ranges into memory."""
    return SOURCES[checkpoint_kind(checkpoint), fetch, False] in _LOCAL


def open_source(checkpoint: Checkpoint, plan: LoadPlan, told: FetchOptions) -> ByteSource:
    """The byte source ``SOURCES`` names for this load, made (Hub files missing from the cache are downloaded first).

    Raises:
        RemoteFileChangedError, CorruptDownloadError: a downloaded file that is not the one planned.
    """
    return SOURCES[checkpoint_kind(checkpoint), told.fetch, in_process_group()](checkpoint, plan, told)
