"""Fetch: bring a Hub checkpoint's planned bytes to this process.

- ``fetch_files``: download into the standard HF cache only the files the plan touches
  (``hf_hub_download``: its locks make concurrent ranks on one machine download each file once).
- ``fetch="ranges"``: no file is downloaded; the byte sources ``sources.http.HttpRanges`` (one process) and
  ``sources.exchange.CooperativeRanges`` (under a process group) fetch exactly the planned byte ranges.
"""

from __future__ import annotations

import os
from typing import Iterable

from huggingface_hub import hf_hub_download

from .errors import RemoteFileChangedError
from .types import Checkpoint, RemoteFile

__all__ = ["fetch_files", "FETCH_MODES"]

FETCH_MODES = ("files", "ranges")


def fetch_files(checkpoint: Checkpoint, needed: Iterable[str], hub: dict, *, tqdm_class=None) -> dict[str, str]:
    """Download the needed repo files at the pinned commit into the HF cache; ``{repo path: local path}``."""
    paths = dict(checkpoint.local_paths)
    for repo_path in needed:
        if repo_path in paths:
            continue
        paths[repo_path] = hf_hub_download(
            checkpoint.repo_id,
            repo_path,
            revision=checkpoint.commit,
            cache_dir=hub.get("cache_dir"),
            force_download=bool(hub.get("force_download")),
            local_files_only=bool(hub.get("local_files_only")),
            token=hub.get("token"),
            tqdm_class=tqdm_class,
        )
        _check_size(checkpoint.remote.get(repo_path), paths[repo_path])
    return paths


def _check_size(remote: RemoteFile | None, path: str) -> None:
    """A downloaded file must be the one the plan read the header of; otherwise drop it from the cache."""
    if remote is not None and os.path.getsize(path) != remote.size:
        size = os.path.getsize(path)
        blob = os.path.realpath(path)
        for stale in {path, blob}:  # the snapshot link and its blob: the cache must not keep a mismatched file
            try:
                os.remove(stale)
            except FileNotFoundError:
                pass
        raise RemoteFileChangedError(
            f"{remote.filename}: the load was planned for {remote.size} bytes but the downloaded file has "
            f"{size}; it was removed from the cache. The repo changed under the pinned commit or the download is "
            "corrupt; load again to re-plan."
        )
