"""Resolve a Hub repo: one pinned commit, the index, and every safetensors header, without shard bodies.

Everything HTTP goes through huggingface_hub (``hf_hub_download`` for small files and whole shards,
``get_hf_file_metadata`` for sizes and etags, its session and headers for the ranged reads), so auth,
offline mode, the cache layout, locks and endpoints behave as everywhere else in the HF stack.

Integrity: every file a Hub load opens is a path inside the repo (checked here, before it is looked up) and,
symlinks followed, inside the repo's HF cache folder; every file downloaded is checked before anything reads it
(``fetch.cache.download``).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Iterable

import torch.distributed as dist
from huggingface_hub import get_hf_file_metadata, hf_hub_url
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

from .distributed.group import current_group, from_rank_zero, is_rank_zero
from .errors import CheckpointNotFoundError, OutsideCheckpointError
from .fetch.cache import HubArgs, cached_file, download, is_404, is_offline, not_found
from .formats import safetensors, torch_pickle
from .resolve import add_tensors, check_index_keys, describe_keys, is_index, parse_index, weight_candidates
from .sources.http import HttpRanges, retry_hub_call
from .types import Checkpoint, CheckpointFormat, RemoteFile

__all__ = ["pin_revision", "resolve_hub"]

_OUTSIDE_REPO_HOW = (
    "lowmem_hf reads only the repo's own files. To load these weights deliberately, download them, copy them into "
    "a local folder with the config and load that folder."
)


def pin_revision(repo_id: str, revision: str | None, hub: HubArgs) -> str:
    """The commit sha ``revision`` points to; under a process group every rank uses rank 0's sha.

    Resolution is ``hf_hub_download`` of ``config.json`` (which follows the branch and records the commit in
    the cache, and works offline from the cache's refs), so a branch that moves mid-load cannot mix commits.
    Every rank downloads ``config.json`` at once (each node has its own cache, and the config is read next), then
    takes rank 0's sha; a rank that saw another commit, or failed, downloads it again at rank 0's sha. (Rank 0
    alone first cost the other ranks a second round of requests, after the broadcast.)
    """
    revision = revision or "main"
    _check_subfolder(repo_id, hub)
    group = current_group()
    shared = group is not None and dist.get_world_size() > 1
    commit, error = None, None
    try:
        commit = _commit_of(_download(repo_id, "config.json", revision, hub))
    except Exception as e:  # re-raised below, after the other ranks have been told (rank 0) or at rank 0's sha
        error = e
    if not shared:
        if error is not None:
            raise error
        return commit
    # rank 0 decides for all, so not ``group.agree``: rank 0 raises its own error unchanged, and another rank's
    # failure is no failure of the load (it downloads again at rank 0's commit)
    chosen = from_rank_zero(commit if error is None else None, group)
    if is_rank_zero():
        if error is not None:
            raise error
        return commit
    if chosen is None:
        raise CheckpointNotFoundError(f"Rank 0 could not resolve {repo_id!r} at revision {revision!r}; see its error.")
    if chosen != commit:  # the branch moved between the ranks' requests, or this rank failed: rank 0's commit
        _download(repo_id, "config.json", chosen, hub)
    return chosen


def _check_subfolder(repo_id: str, hub: HubArgs) -> None:
    """Refuse a ``subfolder`` that leaves the repo before its first request (huggingface_hub's own refusal, a
    ``ValueError`` about a file name, names neither the argument nor the repo)."""
    subfolder = hub.get("subfolder") or ""
    if _leaves_repo(subfolder):
        fix = "Pass the folder's path inside the repo (subfolder='text_encoder'), or '' for its top folder."
        raise OutsideCheckpointError(
            f"subfolder={subfolder!r} leaves the repo {repo_id!r}: a subfolder of a Hub checkpoint is a path inside "
            f"its repo (no '..', not absolute). {fix}",
            key="subfolder", file=subfolder, expected="a path inside the repo", found=repr(subfolder), fix=fix,
        )


def _commit_of(path: str) -> str:
    """The commit of a file in the HF cache: ``.../snapshots/<commit>/<file>``."""
    return path.split(os.sep + "snapshots" + os.sep)[1].split(os.sep)[0]


def _download(
    repo_id: str, filename: str, revision: str, hub: HubArgs, *, expected: RemoteFile | None = None, verify: bool = True
) -> str:
    """``download`` of ``filename`` inside the ``subfolder``."""
    return download(repo_id, _repo_path(filename, hub), revision=revision, hub=hub, expected=expected, verify=verify)


def _repo_path(filename: str, hub: HubArgs) -> str:
    subfolder = hub.get("subfolder") or ""
    return f"{subfolder}/{filename}" if subfolder else filename


def _leaves_repo(repo_path: str) -> bool:
    """Whether a path meant inside a repo is absolute or climbs out of it with ``..``."""
    parts = repo_path.replace("\\", "/").split("/")
    return repo_path.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", repo_path) is not None or ".." in parts


def _check_repo_path(entry: str, repo_path: str, *, repo_id: str, what: str) -> None:
    """Refuse a repo path that leaves the repo (``..``, absolute), as huggingface_hub refuses it for downloads,
    before it is looked up in the cache (where it would lead outside the snapshot)."""
    if _leaves_repo(repo_path):
        shown = f"{entry!r}" + (f" (repo path {repo_path!r})" if repo_path != entry else "")
        raise OutsideCheckpointError(
            f"{what} {shown}, which leaves the repo {repo_id!r}: a file of a Hub checkpoint is a path inside its "
            f"repo (no '..', not absolute). {_OUTSIDE_REPO_HOW}",
            file=entry,
        )


def _remote(repo_id: str, filename: str, commit: str, hub: HubArgs) -> RemoteFile | None:
    """Size and etag of a repo file at ``commit`` (one HEAD request), or ``None`` if the file does not exist."""
    repo_path = _repo_path(filename, hub)
    url = hf_hub_url(repo_id, repo_path, revision=commit)
    try:
        meta = retry_hub_call(
            lambda: get_hf_file_metadata(url, token=hub.get("token")),
            what=f"{filename} (repo {repo_id!r}, revision {commit}): reading its size and etag",
            file=repo_path,
        )
    except EntryNotFoundError:
        return None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise not_found(repo_id, commit, filename, e) from e
    except HfHubHTTPError as e:
        if not is_404(e):
            raise
        return None  # a 404 without the Hub's X-Error-Code: not there either
    return RemoteFile(filename=_repo_path(filename, hub), url=url, size=int(meta.size), etag=meta.etag)


def _remote_header(remote: RemoteFile, hub: HubArgs, keys: Iterable[str] = ()):
    """A remote safetensors file's header, read with Range requests through huggingface_hub's own session,
    retried and checked (size, etag) as the tensor bytes of ``fetch="ranges"`` are. With the index's ``keys``
    of the file, one request for about the header's size (``_header_estimate``); else the length, then the header."""
    source = HttpRanges({remote.filename: remote}, token=hub.get("token"))

    def ranged(start: int, stop: int) -> bytes:
        buffer = bytearray(stop - start)
        source.read(remote.filename, memoryview(buffer), start)
        return bytes(buffer)

    try:
        return safetensors.read_header_by_ranges(
            ranged, size=remote.size, name=remote.filename, first_bytes=_header_estimate(keys)
        )
    finally:
        source.close()


def _first_candidate(
    repo_id: str, candidates: list[str], commit: str, hub: HubArgs, offline: bool
) -> tuple[str | None, RemoteFile | None]:
    """The first of ``candidates`` (in order) that is in the cache or, online, on the Hub (with its HEAD's answer).

    The candidates before the first cached one are probed a format at a time, the single file and its index with
    their HEADs at once: one after the other, a sharded checkpoint paid a round trip for the 404 of
    ``model.safetensors`` before asking for its index. A probe's error is raised only if no candidate before it
    exists, as when they ran in order.
    """
    cached = [cached_file(repo_id, _repo_path(c, hub), commit, hub) is not None for c in candidates]
    before_cached = candidates[: cached.index(True)] if True in cached else candidates
    probes = [] if offline else before_cached
    for pair in (probes[i : i + 2] for i in range(0, len(probes), 2)):  # weight_candidates: (file, index) per format
        with ThreadPoolExecutor(max_workers=len(pair), thread_name_prefix="lowmem-probe") as pool:
            futures = [pool.submit(_remote, repo_id, c, commit, hub) for c in pair]
            for candidate, future in zip(pair, futures):
                remote = future.result()  # raises the probe's error
                if remote is not None:
                    return candidate, remote
    if len(before_cached) < len(candidates):
        return candidates[len(before_cached)], None
    return None, None


def _header_estimate(keys: Iterable[str]) -> int:
    """Bytes to ask for first to get a shard's length prefix and header in one request: safetensors writes one
    entry per tensor, ``"<key>":{"dtype":"BF16","shape":[a,b],"data_offsets":[x,y]},``, about 100 bytes besides
    the key, plus ``__metadata__``. Over by a few hundred bytes per shard; a larger header costs a second request."""
    keys = list(keys)
    return 8 + sum(len(k) + 112 for k in keys) + 512 if keys else 8


@dataclass(frozen=True)
class _PinnedRepo:
    """A Hub repo at one commit, seen through its ``subfolder``: what every step of ``resolve_hub`` asks about."""

    repo_id: str
    commit: str
    hub: HubArgs
    offline: bool
    probed: RemoteFile | None
    """The chosen candidate's HEAD answer, when the candidate probe made one: not asked for again."""

    def path(self, name: str) -> str:
        return _repo_path(name, self.hub)

    def cached(self, name: str) -> str | None:
        return cached_file(self.repo_id, self.path(name), self.commit, self.hub)

    def planned(self, name: str) -> RemoteFile | None:
        """The size and etag of ``name`` at ``commit`` (one HEAD unless the candidate probe made it), or None offline."""
        if self.offline:
            return None
        if self.probed is not None and self.probed.filename == self.path(name):
            return self.probed
        found_remote = _remote(self.repo_id, name, self.commit, self.hub)
        if found_remote is None:
            raise CheckpointNotFoundError(
                f"Cannot load {self.repo_id!r} (revision {self.commit!r}): the index names {self.path(name)!r}, which "
                "the repo does not have at that revision."
            )
        return found_remote


def _choose_weights(
    repo_id: str, commit: str, hub: HubArgs, offline: bool, candidates: list[str], what: str
) -> tuple[str, RemoteFile | None]:
    """The weight file (or index) to load, of ``candidates`` in order, each checked to stay inside the repo first;
    with its HEAD's answer when the probe made one."""
    for candidate in candidates:
        _check_repo_path(candidate, _repo_path(candidate, hub), repo_id=repo_id, what=what)
    found, remote_found = _first_candidate(repo_id, candidates, commit, hub, offline)
    if found is None:
        raise CheckpointNotFoundError(
            f"Cannot load {repo_id!r} (revision {commit!r}): none of {', '.join(candidates)} exists"
            + (" in the local cache (offline mode)" if offline else "")
            + ". Check `variant`, `subfolder` and `use_safetensors`."
        )
    return found, remote_found


def _read_index(repo: _PinnedRepo, index: str, verify: bool) -> tuple[dict[str, list[str]], dict, int]:
    """The index's keys of each shard, its metadata and its size in bytes; every shard it names is checked to stay
    inside the repo before any shard is looked up."""
    index_path = _download(repo.repo_id, index, repo.commit, repo.hub, expected=repo.probed, verify=verify)
    nbytes = os.path.getsize(index_path)
    by_file, index_metadata = parse_index(index_path)
    for name, keys in by_file.items():
        _check_repo_path(name, repo.path(name), repo_id=repo.repo_id, what=f"{index} maps {describe_keys(keys)} to")
    return by_file, index_metadata, nbytes


def _remote_headers(repo: _PinnedRepo, names: list[str], shard_keys: dict[str, list[str]]) -> dict[str, tuple]:
    """``{name: (RemoteFile, header)}`` of the safetensors shards not in the cache, read concurrently when there is
    more than one: each costs three requests in a row (HEAD, header length, header), and with the Hub's
    per-request latency, shards one after another would be most of the planning of a fetch="ranges" load."""
    todo = [n for n in names if repo.cached(n) is None]
    if len(todo) <= 1:
        return {}

    def header(name: str):
        planned_remote = repo.planned(name)
        return planned_remote, _remote_header(planned_remote, repo.hub, shard_keys.get(name, ()))

    with ThreadPoolExecutor(max_workers=min(8, len(todo)), thread_name_prefix="lowmem-headers") as pool:
        return dict(zip(todo, pool.map(header, todo)))  # the first error, in shard order, is raised


def _safetensors_header(
    repo: _PinnedRepo, name: str, headers: dict[str, tuple]
) -> tuple[str | None, RemoteFile | None, tuple]:
    """``(cached path, RemoteFile, (infos, header bytes))`` of a safetensors shard: read in the cache if it is
    there (offline: downloaded, or huggingface_hub's own offline error), else by ranges (``headers``: read already)."""
    cached = repo.cached(name)
    if cached is not None:
        return cached, None, safetensors.read_header(cached)
    if repo.offline:
        cached = _download(repo.repo_id, name, repo.commit, repo.hub)  # raises huggingface_hub's own offline error
        return cached, None, safetensors.read_header(cached)
    if name in headers:
        remote, header = headers[name]
        return None, remote, header
    remote = repo.planned(name)
    return None, remote, _remote_header(remote, repo.hub)


def _pickle_header(repo: _PinnedRepo, name: str, weights_only: bool, verify: bool) -> tuple[str, tuple]:
    """``(cached path, (infos, bytes read, format))`` of a ``.bin`` shard: it has no readable header, so it is
    downloaded (into the cache) whole to learn its shapes, as transformers does."""
    cached = repo.cached(name)
    if cached is None:  # offline, download raises huggingface_hub's own offline error
        cached = _download(repo.repo_id, name, repo.commit, repo.hub, expected=repo.planned(name), verify=verify)
    return cached, torch_pickle.read_header(cached, weights_only=weights_only)


def resolve_hub(
    repo_id: str,
    *,
    commit: str,
    hub: HubArgs,
    variant: str | None,
    use_safetensors: bool | None,
    explicit_filename: str | None,
    weights_only: bool,
    verify: bool = True,
) -> Checkpoint:
    """Describe a Hub checkpoint at ``commit`` from its index and headers; download no safetensors shard body.

    Files already in the HF cache are read there. ``.bin`` shards have no readable header: they are
    downloaded (into the cache) whole to learn their shapes, as transformers does, and checked as ``download``
    checks every file it downloads (``verify``: hash LFS files against their sha256). Every file name (weights,
    ``config.transformers_weights``, index entries, with ``subfolder`` and ``variant``) must stay inside the repo,
    checked before any file is looked up.

    Raises:
        CheckpointNotFoundError: no weights of an accepted kind at that commit (names repo, revision, files).
        OutsideCheckpointError: a file name that leaves the repo, or a cached file that links outside its cache folder.
        RemoteFileChangedError, CorruptDownloadError: a downloaded file that is not the one planned (see ``download``).
    """
    offline = is_offline(hub)
    candidates = weight_candidates(variant=variant, use_safetensors=use_safetensors, explicit_filename=explicit_filename)
    what = "config.json's transformers_weights names" if explicit_filename is not None else "The weight file is"
    found, remote_found = _choose_weights(repo_id, commit, hub, offline, candidates, what)
    repo = _PinnedRepo(repo_id, commit, hub, offline, remote_found)

    header_bytes = 0
    index_metadata = None
    shard_keys = {}  # the index's keys of each shard: how large its header is
    if is_index(found):
        shard_keys, index_metadata, header_bytes = _read_index(repo, found, verify)
        names = sorted(shard_keys)
    else:
        names = [found]

    is_safetensors = names[0].endswith(".safetensors")
    headers = _remote_headers(repo, names, shard_keys) if is_safetensors and not offline else {}
    fmt = CheckpointFormat.SAFETENSORS if is_safetensors else None
    tensors, remote, local_paths = {}, {}, {}
    for name in names:
        repo_path = repo.path(name)
        if is_safetensors:
            cached, remote_file, (infos, nbytes) = _safetensors_header(repo, name, headers)
            if remote_file is not None:
                remote[repo_path] = remote_file
        else:
            cached, (infos, nbytes, file_fmt) = _pickle_header(repo, name, weights_only, verify)
            fmt = file_fmt if fmt in (None, CheckpointFormat.TORCH_ZIP) else fmt
        if cached is not None:
            local_paths[repo_path] = cached
        header_bytes += nbytes
        add_tensors(tensors, (replace(info, file=repo_path) for info in infos.values()))
    if index_metadata is not None:
        check_index_keys(found, shard_keys, tensors)
    return Checkpoint(
        name_or_path=repo_id,
        format=fmt,
        files=tuple(repo.path(n) for n in names),
        tensors=tensors,
        index_metadata=index_metadata,
        header_bytes=header_bytes,
        repo_id=repo_id,
        commit=commit,
        remote=remote,
        local_paths=local_paths,
    )
