"""Fetch: bring a checkpoint's planned bytes to this process.

- ``choose.open_source``: the table that picks the byte source from where the checkpoint is, the fetch mode and
  the process group.
- ``fetch_files``: download into the standard HF cache only the files the plan touches
  (``hf_hub_download``: its locks make concurrent ranks on one machine download each file once). Each file
  downloaded here is checked before the stream reads it (``cache.download``): the size and etag it was planned
  with, and for LFS files the sha256 the Hub publishes (``verify``). Files download concurrently, as
  ``snapshot_download`` does, so one file's hashing overlaps the next one's download.
- ``fetch="ranges"``: no file is downloaded; the byte sources ``sources.http.HttpRanges`` (one process) and
  ``sources.exchange.CooperativeRanges`` (under a process group) fetch exactly the planned byte ranges.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from ..settings import async_load
from ..types import Checkpoint
from .cache import download

__all__ = ["fetch_files", "FETCH_MODES", "DOWNLOAD_WORKERS"]

FETCH_MODES = ("files", "ranges")
DOWNLOAD_WORKERS = 8
"""Files downloaded (and hashed) at once: huggingface_hub's ``snapshot_download`` default."""


def fetch_files(
    checkpoint: Checkpoint, needed: Iterable[str], hub: dict, *, verify: bool = True, tqdm_class=None
) -> dict[str, str]:
    """Download the needed repo files at the pinned commit into the HF cache; ``{repo path: local path}``.

    Files resolve found in the cache are read there as they are. Every other file is downloaded and checked
    (``cache.download``); with ``verify``, an LFS file is hashed against its sha256 before it is returned.

    Raises:
        RemoteFileChangedError: a file's size or etag differs from the plan (it is removed from the cache).
        CorruptDownloadError: a file's sha256 differs from the Hub's, twice (it is removed from the cache).
    """
    paths = dict(checkpoint.local_paths)
    todo = [p for p in dict.fromkeys(needed) if p not in paths]
    if not todo:
        return paths

    def one(repo_path: str) -> str:
        return download(
            checkpoint.repo_id,
            repo_path,
            revision=checkpoint.commit,
            hub=hub,
            expected=checkpoint.remote.get(repo_path),
            verify=verify,
            tqdm_class=tqdm_class,
        )

    if not async_load():  # transformers' switch: no thread started
        paths.update((p, one(p)) for p in todo)
        return paths
    executor = ThreadPoolExecutor(max_workers=min(DOWNLOAD_WORKERS, len(todo)), thread_name_prefix="lowmem-download")
    try:
        paths.update(zip(todo, executor.map(one, todo)))  # the first failure (in plan order) is raised
    finally:
        executor.shutdown(wait=True, cancel_futures=True)  # no download left running behind an error
    return paths
