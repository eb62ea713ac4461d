"""Resolve a Hub repo: one pinned commit, the index, and every safetensors header, without shard bodies.

Everything HTTP goes through huggingface_hub (``hf_hub_download`` for small files and whole shards,
``get_hf_file_metadata`` for sizes and etags, its session and headers for the ranged reads), so auth,
offline mode, the cache layout, locks and endpoints behave as everywhere else in the HF stack.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch.distributed as dist
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.constants import is_offline_mode

from .errors import CheckpointNotFoundError
from .formats import safetensors, torch_pickle
from .resolve import add_tensors, is_index, parse_index, weight_candidates
from .sources.http import HttpRanges
from .types import Checkpoint, CheckpointFormat, RemoteFile

__all__ = ["pin_revision", "resolve_hub", "HubArgs"]

HubArgs = dict  # cache_dir, force_download, local_files_only, proxies, token, subfolder (as transformers names them)


def _offline(hub: HubArgs) -> bool:
    return bool(hub.get("local_files_only")) or is_offline_mode()


def _not_found(repo_id: str, revision: str, filename: str, e: Exception) -> CheckpointNotFoundError:
    what = {
        RepositoryNotFoundError: f"the repo {repo_id!r} does not exist (or you lack access: pass token=...)",
        RevisionNotFoundError: f"the repo {repo_id!r} has no revision {revision!r}",
        EntryNotFoundError: f"the repo {repo_id!r} at revision {revision!r} has no file {filename!r}",
    }
    reason = next((text for cls, text in what.items() if isinstance(e, cls)), str(e))
    return CheckpointNotFoundError(f"Cannot load {repo_id!r} (revision {revision!r}, file {filename!r}): {reason}.")


def pin_revision(repo_id: str, revision: str | None, hub: HubArgs) -> str:
    """The commit sha ``revision`` points to; under a process group rank 0 resolves and every rank uses its sha.

    Resolution is ``hf_hub_download`` of ``config.json`` (which follows the branch and records the commit in
    the cache, and works offline from the cache's refs), so a branch that moves mid-load cannot mix commits.
    """
    revision = revision or "main"
    shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    commit, error = None, None
    if not shared or dist.get_rank() == 0:
        try:
            commit = _download(repo_id, "config.json", revision, hub).split(os.sep + "snapshots" + os.sep)[1].split(os.sep)[0]
        except Exception as e:  # re-raised below, after the other ranks have been told
            error = e
    if shared:
        box = [commit if error is None else None]
        dist.broadcast_object_list(box, src=0)
        commit = box[0]
        if commit is None and error is None:
            raise CheckpointNotFoundError(f"Rank 0 could not resolve {repo_id!r} at revision {revision!r}; see its error.")
    if error is not None:
        raise error
    return commit


def _download(repo_id: str, filename: str, revision: str, hub: HubArgs) -> str:
    subfolder = hub.get("subfolder") or None
    try:
        return hf_hub_download(
            repo_id,
            filename,
            subfolder=subfolder,
            revision=revision,
            cache_dir=hub.get("cache_dir"),
            force_download=bool(hub.get("force_download")),
            local_files_only=bool(hub.get("local_files_only")),
            token=hub.get("token"),
        )
    except LocalEntryNotFoundError:
        raise  # offline and not cached: huggingface_hub's own error says exactly that
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        raise _not_found(repo_id, revision, filename, e) from e


def _repo_path(filename: str, hub: HubArgs) -> str:
    subfolder = hub.get("subfolder") or ""
    return f"{subfolder}/{filename}" if subfolder else filename


def _remote(repo_id: str, filename: str, commit: str, hub: HubArgs) -> RemoteFile | None:
    """Size and etag of a repo file at ``commit`` (one HEAD request), or ``None`` if the file does not exist."""
    url = hf_hub_url(repo_id, _repo_path(filename, hub), revision=commit)
    try:
        meta = get_hf_file_metadata(url, token=hub.get("token"))
    except EntryNotFoundError:
        return None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise _not_found(repo_id, commit, filename, e) from e
    return RemoteFile(filename=_repo_path(filename, hub), url=url, size=int(meta.size), etag=meta.etag)


def _cached(repo_id: str, filename: str, commit: str, hub: HubArgs) -> str | None:
    path = try_to_load_from_cache(repo_id, _repo_path(filename, hub), cache_dir=hub.get("cache_dir"), revision=commit)
    return path if isinstance(path, str) else None


def _ranged(remote: RemoteFile, start: int, stop: int, hub: HubArgs) -> bytes:
    """Bytes ``[start, stop)`` of a remote file through huggingface_hub's own session (exactly those bytes),
    retried and checked (size, etag) as the tensor bytes of ``fetch="ranges"`` are."""
    buffer = bytearray(stop - start)
    source = HttpRanges({remote.filename: remote}, token=hub.get("token"))
    try:
        source.read(remote.filename, memoryview(buffer), start)
    finally:
        source.close()
    return bytes(buffer)


def _remote_header(remote: RemoteFile, hub: HubArgs):
    """A remote safetensors file's header, read with two Range requests (its length, then the header)."""
    return safetensors.read_header_by_ranges(lambda start, stop: _ranged(remote, start, stop, hub), size=remote.size, name=remote.filename)


def resolve_hub(
    repo_id: str,
    *,
    commit: str,
    hub: HubArgs,
    variant: str | None,
    use_safetensors: bool | None,
    explicit_filename: str | None,
    weights_only: bool,
) -> Checkpoint:
    """Describe a Hub checkpoint at ``commit`` from its index and headers; download no safetensors shard body.

    Files already in the HF cache are read there. ``.bin`` shards have no readable header: they are
    downloaded (into the cache) whole to learn their shapes, as transformers does.

    Raises:
        CheckpointNotFoundError: no weights of an accepted kind at that commit (names repo, revision, files).
    """
    offline = _offline(hub)
    candidates = weight_candidates(variant=variant, use_safetensors=use_safetensors, explicit_filename=explicit_filename)

    found, remote_found = None, None
    for candidate in candidates:
        if _cached(repo_id, candidate, commit, hub) is not None:
            found = candidate
            break
        if not offline:
            remote_found = _remote(repo_id, candidate, commit, hub)
            if remote_found is not None:
                found = candidate
                break
    if found is None:
        raise CheckpointNotFoundError(
            f"Cannot load {repo_id!r} (revision {commit!r}): none of {', '.join(candidates)} exists"
            + (" in the local cache (offline mode)" if offline else "")
            + ". Check `variant`, `subfolder` and `use_safetensors`."
        )

    header_bytes = 0
    index_metadata = None
    if is_index(found):
        index_path = _download(repo_id, found, commit, hub)
        header_bytes += os.path.getsize(index_path)
        by_file, index_metadata = parse_index(index_path)
        names = sorted(by_file)
    else:
        names = [found]

    is_safetensors = names[0].endswith(".safetensors")
    tensors, remote, local_paths = {}, {}, {}
    fmt = CheckpointFormat.SAFETENSORS if is_safetensors else None
    for name in names:
        repo_path = _repo_path(name, hub)
        cached = _cached(repo_id, name, commit, hub)
        if not is_safetensors:
            cached = cached or _download(repo_id, name, commit, hub)
            infos, nbytes, file_fmt = torch_pickle.read_header(cached, weights_only=weights_only)
            fmt = file_fmt if fmt in (None, CheckpointFormat.TORCH_ZIP) else fmt
        elif cached is not None:
            infos, nbytes = safetensors.read_header(cached)
        elif offline:
            cached = _download(repo_id, name, commit, hub)  # raises huggingface_hub's own offline error
            infos, nbytes = safetensors.read_header(cached)
        else:
            remote[repo_path] = (remote_found if remote_found and remote_found.filename == repo_path
                                 else _remote(repo_id, name, commit, hub))
            if remote[repo_path] is None:
                raise CheckpointNotFoundError(
                    f"Cannot load {repo_id!r} (revision {commit!r}): the index names {repo_path!r}, which the repo "
                    "does not have at that revision."
                )
            infos, nbytes = _remote_header(remote[repo_path], hub)
        if cached is not None:
            local_paths[repo_path] = cached
        header_bytes += nbytes
        add_tensors(tensors, (replace(info, file=repo_path) for info in infos.values()))
    return Checkpoint(
        name_or_path=repo_id,
        format=fmt,
        files=tuple(_repo_path(n, hub) for n in names),
        tensors=tensors,
        index_metadata=index_metadata,
        header_bytes=header_bytes,
        repo_id=repo_id,
        commit=commit,
        remote=remote,
        local_paths=local_paths,
    )
