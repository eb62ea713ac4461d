"""One repo file into the HF cache, checked before anything reads it, and the cached copy of a repo file.

Integrity: a file a Hub load opens from the cache must resolve, symlinks followed, inside the repo's HF cache
folder. A file downloaded during the load must have the size and etag it was planned with and, for LFS files,
whose etag is the sha256 of the content, hash to that etag before anything reads it; a corrupt download is removed
from the cache and fetched once more, so the cache never keeps a file that fails the check.
"""

from __future__ import annotations

import hashlib
import os
import re

from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.constants import is_offline_mode
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name

from ..errors import CheckpointNotFoundError, CorruptDownloadError, RemoteFileChangedError
from ..resolve import check_real_path
from ..sources.http import retry_hub_call
from ..types import RemoteFile

__all__ = [
    "download", "file_sha256", "cached_file", "check_in_cache", "not_found", "is_404", "is_offline", "HubArgs",
    "HASH_BLOCK_BYTES",
]

HASH_BLOCK_BYTES = 16 * 1024 * 1024
"""Block size of ``file_sha256``: large enough that hashing runs at the hash's speed, not the syscalls'."""
_SHA256 = re.compile(r"[0-9a-f]{64}")

HubArgs = dict  # cache_dir, force_download, local_files_only, proxies, token, subfolder (as transformers names them)


def is_offline(hub: HubArgs) -> bool:
    """No request may be made: ``local_files_only`` or huggingface_hub's offline mode."""
    return bool(hub.get("local_files_only")) or is_offline_mode()


def not_found(repo_id: str, revision: str, filename: str, e: Exception) -> CheckpointNotFoundError:
    """huggingface_hub's not-found error ``e`` as ours, naming the repo, the revision and the file."""
    what = {
        RepositoryNotFoundError: f"the repo {repo_id!r} does not exist (or you lack access: pass token=...)",
        RevisionNotFoundError: f"the repo {repo_id!r} has no revision {revision!r}",
        EntryNotFoundError: f"the repo {repo_id!r} at revision {revision!r} has no file {filename!r}",
    }
    reason = next((text for cls, text in what.items() if isinstance(e, cls)), None)
    if reason is None:
        reason = f"the server answered 404 Not Found for {filename!r} ({e})" if is_404(e) else str(e)
    return CheckpointNotFoundError(f"Cannot load {repo_id!r} (revision {revision!r}, file {filename!r}): {reason}.")


def is_404(e: Exception) -> bool:
    """An HTTP error answered 404 (with or without the Hub's ``X-Error-Code``)."""
    response = getattr(e, "response", None)
    return response is not None and response.status_code == 404


def download(
    repo_id: str,
    repo_path: str,
    *,
    revision: str,
    hub: HubArgs,
    expected: RemoteFile | None = None,
    verify: bool = True,
    tqdm_class=None,
) -> str:
    """One repo file into the HF cache with ``hf_hub_download``, checked before anything reads it; its local path.

    A file already in the cache at a pinned commit is returned as it is, with no request and no hashing: what
    lowmem_hf downloads was checked when it was downloaded, and hashing every cached file on every load would add
    its hashing time to every warm load (``benchmarks/bench_verify.py``). Otherwise the file must resolve inside the
    repo's cache folder; have the size and etag
    of ``expected`` (the metadata the load was planned with), if given; and, when ``verify`` is on and the file is
    an LFS file (its etag is a sha256), hash to its etag. A file that fails the hash is removed from the cache and
    downloaded once more; nothing that fails a check stays in the cache.

    Args:
        repo_id: the repo.
        repo_path: the file's path in the repo (``subfolder`` included).
        revision: the pinned commit (a branch only for ``pin_revision``'s ``config.json``).
        hub: cache_dir, force_download, local_files_only, token.
        expected: the size and etag the load was planned with.
        verify: hash LFS files this call downloads (``from_pretrained(verify_downloads=...)``).
        tqdm_class: huggingface_hub's progress bar class.

    Raises:
        CheckpointNotFoundError: the repo, revision or file does not exist.
        RemoteFileChangedError: the download's size or etag is not ``expected``'s.
        CorruptDownloadError: the sha256 differs from the etag twice in a row.
        OutsideCheckpointError: the cached file links outside the repo's cache folder.
    """
    offline = is_offline(hub)
    force = bool(hub.get("force_download"))
    if _is_commit(revision) and not force:
        cached = cached_file(repo_id, repo_path, revision, hub)
        if cached is not None:
            return cached
    hashes = []
    for attempt in range(2):
        path = _hf_download(repo_id, repo_path, revision, hub, force=force or attempt > 0, tqdm_class=tqdm_class)
        check_in_cache(path, repo_id, repo_path, hub)
        etag = _blob_etag(path) or (expected.etag if expected is not None else None)
        if expected is not None:
            _check_planned(expected, path, etag)
        if offline or not verify or etag is None or not _SHA256.fullmatch(etag):
            return path  # nothing downloaded, verification off, or no published sha256 (a non-LFS file)
        try:
            hashes.append(file_sha256(path))
        except FileNotFoundError:  # another process of this machine found the same download corrupt and removed it
            hashes.append("nothing (removed meanwhile by another process)")
            continue
        if hashes[-1] == etag:
            return path
        _evict(path)
    raise CorruptDownloadError(
        f"{repo_path} (repo {repo_id!r}, revision {revision}): the Hub publishes sha256 {etag} for it (its ETag), "
        f"but the downloaded bytes hash to {hashes[0]}, and after a second download to {hashes[1]}. The corrupt file "
        "was removed from the HF cache. Something between the Hub and this machine changes the bytes (a proxy, the "
        "network, the disk): fix that and load again. verify_downloads=False skips this check, at the risk of a "
        "wrong model."
    )


def _hf_download(repo_id: str, repo_path: str, revision: str, hub: HubArgs, *, force: bool, tqdm_class) -> str:
    """``hf_hub_download``, retried on dropped connections; huggingface_hub's not-found errors as ours."""
    try:
        return retry_hub_call(
            lambda: hf_hub_download(
                repo_id,
                repo_path,
                revision=revision,
                cache_dir=hub.get("cache_dir"),
                force_download=force,
                local_files_only=bool(hub.get("local_files_only")),
                token=hub.get("token"),
                tqdm_class=tqdm_class,
            ),
            what=f"{repo_path} (repo {repo_id!r}, revision {revision}): downloading it",
            file=repo_path,
        )
    except LocalEntryNotFoundError:
        raise  # offline and not cached: huggingface_hub's own error says exactly that
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        raise not_found(repo_id, revision, repo_path, e) from e
    except HfHubHTTPError as e:
        if not is_404(e):
            raise
        raise not_found(repo_id, revision, repo_path, e) from e  # a 404 without the Hub's X-Error-Code


def file_sha256(path: str, *, block_bytes: int = HASH_BLOCK_BYTES) -> str:
    """The hex sha256 of a file, read in ``block_bytes`` blocks into one reused buffer (hashlib releases the
    GIL on large blocks, so other threads keep running)."""
    digest = hashlib.sha256()
    buffer = bytearray(block_bytes)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def _is_commit(revision: str) -> bool:
    return bool(re.fullmatch(r"[0-9a-f]{40}", revision or ""))


def _blob_etag(path: str) -> str | None:
    """The etag huggingface_hub downloaded the file under: its blob's name (``snapshots/<sha>/f -> ../../blobs/<etag>``);
    None where the cache holds copies instead of links (no symlink support)."""
    return os.path.basename(os.readlink(path)) if os.path.islink(path) else None


def _evict(path: str) -> None:
    """Remove a snapshot file and the repo blob it links to (one hop: a shared-store blob behind it stays)."""
    stale = [path]
    if os.path.islink(path):
        stale.append(os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path))))
    for file in stale:
        try:
            os.remove(file)
        except FileNotFoundError:
            pass


def _check_planned(remote: RemoteFile, path: str, etag: str | None) -> None:
    """A downloaded file must be the one the load was planned with; otherwise drop it from the cache."""
    size = os.path.getsize(path)
    if size != remote.size:
        _evict(path)
        raise RemoteFileChangedError(
            f"{remote.filename}: the load was planned for {remote.size} bytes but the downloaded file has "
            f"{size}; it was removed from the cache. The repo changed under the pinned commit or the download is "
            "corrupt; load again to re-plan."
        )
    if etag is not None and remote.etag is not None and etag != remote.etag:
        _evict(path)
        raise RemoteFileChangedError(
            f"{remote.filename}: the load was planned for etag {remote.etag} but the file was downloaded with etag "
            f"{etag}; it was removed from the cache. The file changed between the two requests (under the pinned "
            "commit); load again to re-plan."
        )


def _cache_folder(repo_id: str, hub: HubArgs) -> tuple[str, tuple[str, ...]]:
    """The repo's folder in the HF cache, and where its files may resolve: the folder itself (snapshots link to
    its ``blobs``) and the cache's shared blob store (``<cache>/blobs``, where Xet-deduplicated blobs link)."""
    cache_dir = os.fspath(hub.get("cache_dir") or constants.HF_HUB_CACHE)
    folder = os.path.join(cache_dir, repo_folder_name(repo_id=repo_id, repo_type="model"))
    return folder, (os.path.join(cache_dir, "blobs"),)


def check_in_cache(path: str, repo_id: str, repo_path: str, hub: HubArgs) -> None:
    folder, roots = _cache_folder(repo_id, hub)
    check_real_path(path, folder, what=f"The cached file of {repo_id!r}", entry=repo_path, roots=roots)


def cached_file(repo_id: str, repo_path: str, commit: str, hub: HubArgs) -> str | None:
    """The cached copy of a repo file at ``commit``, checked to resolve inside the repo's cache folder; or None."""
    path = try_to_load_from_cache(repo_id, repo_path, cache_dir=hub.get("cache_dir"), revision=commit)
    if not isinstance(path, str):
        return None
    check_in_cache(path, repo_id, repo_path, hub)
    return path
