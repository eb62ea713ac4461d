"""A loopback fake of the Hugging Face Hub, for tests: real clients, no mocks, no Internet.

``HubServer`` is a stdlib ``ThreadingHTTPServer`` on ``127.0.0.1:<free port>`` (plus a second one acting as the
CDN, see ``redirect_large``) that speaks the part of the Hub protocol that huggingface_hub 2.4 and transformers 5
use to download: ``hf_hub_download``, ``snapshot_download``, ``HfApi().model_info / repo_info / list_repo_tree /
get_paths_info / list_repo_refs / list_repo_commits / file_exists``, ``get_session()`` ranged GETs,
``HfFileSystem`` reads, and ``transformers.*.from_pretrained("org/name")``::

    server = HubServer(tmp_path / "hub")                   # root/<org>/<name>/<commit sha>/<files>
    sha = server.add_repo("org/name", folder_or_mapping)    # "main" at a deterministic 40-hex sha
    sha2 = server.add_revision("org/name", "dev", folder)   # second commit, on branch "dev" (parent = main)
    with server, use_hub(server, hf_home):                  # start; point huggingface_hub at it
        hf_hub_download("org/name", "config.json")
        server.bytes_sent, server.requests, server.bytes_for("org/name", "model.safetensors")

Pointing the clients at the server (HF_ENDPOINT)
------------------------------------------------
huggingface_hub reads ``HF_ENDPOINT`` (and ``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_TELEMETRY``, ...) ONCE,
when ``huggingface_hub.constants`` is first imported, and the server's port is only known once it runs. So setting
``os.environ["HF_ENDPOINT"]`` in a test does nothing if anything imported huggingface_hub/transformers before (pytest
collection does). What works:

* in-process: ``with use_hub(server, hf_home):`` patches the module attributes every call site reads at call time
  (``huggingface_hub.constants.ENDPOINT``, ``HUGGINGFACE_CO_URL_TEMPLATE``, ``HF_HUB_OFFLINE=False``,
  ``HF_HUB_DISABLE_TELEMETRY=True``, ``HF_HOME``/``HF_HUB_CACHE``/``HF_ASSETS_CACHE``, the token paths) and restores
  them on exit. This covers hf_hub_download, snapshot_download, HfApi(), HfFileSystem(), hf_hub_url and transformers'
  ``from_pretrained`` (transformers reads ``huggingface_hub.constants`` at call time too). Passing ``endpoint=``
  explicitly is NOT enough on its own: transformers has no ``endpoint`` argument, and ``constants.HF_HUB_OFFLINE``
  must be off (tests/conftest.py puts ``HF_HUB_OFFLINE=1`` in the environment, which sticks if huggingface_hub is
  first imported after that fixture ran);
* subprocess: ``subprocess.run(..., env=server.subprocess_env(hf_home))`` sets ``HF_ENDPOINT``, ``HF_HOME``,
  ``HF_HUB_OFFLINE=0``, ``TRANSFORMERS_OFFLINE=0``, ``HF_HUB_DISABLE_TELEMETRY=1`` and drops ``HF_TOKEN``.

With telemetry enabled, the first ``build_hf_headers()`` of a process GETs ``{ENDPOINT}/api/agent-harnesses`` (to
detect AI agents); the server answers it with an empty registry, and ``use_hub`` disables telemetry anyway.

What the server sends (matching huggingface_hub 2.4's file_download.py / utils/_http.py)
----------------------------------------------------------------------------------------
``HEAD|GET /{repo}/resolve/{rev}/{path}`` (``rev`` = branch, tag, ``refs%2Fpr%2F1`` or 40-hex sha, URL-encoded):
    200 with ``ETag: "<git blob sha1>"`` (small) or ``ETag: "<sha256>"`` + ``X-Linked-Etag: "<sha256>"`` +
    ``X-Linked-Size`` (large = LFS-like: size > ``large_threshold`` or name matching ``lfs_patterns``),
    ``X-Repo-Commit``, ``Content-Length``, ``Accept-Ranges: bytes``. Never ``X-Xet-Hash``: the clients thus
    download over plain HTTP (xet needs a CAS server). Large files with ``redirect_large`` set: 302 (HEAD and GET)
    with ``Location`` to ``/cdn/{repo}/{commit}/{path}`` and the Hub headers (``X-Repo-Commit``, ``X-Linked-*``,
    ``ETag`` = git sha1 of the LFS pointer). huggingface_hub follows a HEAD redirect only when it stays on the same
    origin (or a known Hub origin), so:

    * ``redirect_large="cross"`` (or ``True``): Location is on the second server (other port = other origin, like
      the real CDN). The client reads the metadata from the 302 itself, drops ``Authorization``, and GETs the CDN.
      CDN responses carry ``ETag: "<sha256>"``, ``Content-Length``/``Content-Range``, ``Content-Disposition``
      and NO Hub headers (like the real CDN).
    * ``redirect_large="same"``: Location is ``/cdn/...`` on the same server. The client follows it even for HEAD
      and reads the metadata from the final response, so here the ``/cdn`` responses also carry ``X-Repo-Commit``
      and ``X-Linked-*`` (like a Hub mirror or a renamed-repo redirect would).
``Range``: ``bytes=a-b`` (b clamped to size-1), ``bytes=a-`` and ``bytes=-n`` -> 206 + ``Content-Range: bytes
    a-b/size``. A start past the end, a multi-range (``bytes=0-1,5-6``) or an unparsable range -> 416 with
    ``Content-Range: bytes */size`` (deliberately strict, so a client sending one is caught, not silently served
    the whole file). Range on HEAD answers the same headers as the GET would.
Errors: 404 + ``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound`` + ``X-Error-Message`` + JSON body
    ``{"error": ...}``; EntryNotFound on resolve also carries ``X-Repo-Commit`` (the client caches ``.no_exist``).
    Only model repos exist: ``/datasets/...``, ``/spaces/...`` are RepoNotFound.
API: ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` (model_info: ``id``, ``sha``,
    ``siblings`` [+ ``size``, ``blobId``, ``lfs`` with ``?blobs=true``], dates, ...); ``GET
    /api/models/{repo}/tree/{rev}[/{path}]?recursive=&cursor=`` (``{"type": "file"|"directory", "path", "size",
    "oid"}`` + ``"lfs": {"oid": sha256, "size", "pointerSize"}`` for large files; paginated with a ``Link: <..>;
    rel="next"`` header every ``tree_page_size`` entries); ``POST /api/models/{repo}/paths-info/{rev}`` (form or
    JSON ``paths``; unknown paths omitted; ``expand`` adds ``lastCommit``); ``GET /api/models/{repo}/refs`` and
    ``/commits/{rev}``; ``GET /api/agent-harnesses``. Anything else: 404 JSON without ``X-Error-Code``.

Accounting (thread-safe; reading waits up to 2 s for in-flight requests to finish, so a client that just got its
bytes sees them counted): ``server.requests`` (list of ``RequestRecord``: method, path, range, status, bytes_sent,
repo_id, filename, revision, commit, client, origin "hub"/"cdn", cut, headers), ``server.bytes_sent``,
``server.bytes_by_file`` ({(repo_id, filename): n}), ``server.bytes_by_client`` (key: ``X-Client-Id`` request
header, else the client IP), ``server.bytes_for(repo_id, filename=None)``, ``server.reset_counters()``. Only body
bytes count (headers do not; HEAD counts 0).

Fault knobs (settable at any time, also while serving): ``throttle_bytes_per_s``, ``cut_after_bytes`` /
``cut_next()``, ``fail_next()``, ``corrupt_next()`` (bytes flipped in transit, length and ETag kept), ``latency_s``,
``replace_file()`` (optionally keeping the old ETag, optionally deferred until the client has planned),
``override_size()``, ``redirect_large``, ``tree_page_size``, ``clear_faults()``. See each one's docstring.

What huggingface_hub 2.4 does on those faults (pinned by tests/test_hub_server.py)
-------------------------------------------------------------------------------
* short body (``cut_next(mode="close")``): ``hf_hub_download`` sleeps 1 s and resumes, but from the last complete
  10 MiB ``DOWNLOAD_CHUNK_SIZE`` chunk (``Range: bytes=10485760-``): a smaller file is fetched again from 0.
* TCP reset (``mode="reset"``): ``httpx2.ReadError`` propagates out of ``hf_hub_download``, no retry.
* 5xx on the HEAD: retried once more with backoff and succeeds; 5xx on the GET: raised (only 408/429 retried).
* content swapped after the HEAD (``replace_file(when="head")``): same size is NOT detected (plain HTTP downloads
  are not hashed, the new bytes are cached under the old sha256); another size raises ``OSError("Consistency
  check failed ...")``.
* transformers 5 ``from_pretrained("org/name")`` first calls ``GET /api/models/org/name`` (to resolve the
  revision), then downloads every file by commit sha; so the model_info endpoint is required.

Bounds: each connection has a socket timeout (``timeout``, default 10 s) for reads and writes, throttling sleeps at
most 0.25 s at a time, request bodies are capped at 1 MiB, ``stop()``/``__exit__`` shuts the listeners and every
open connection down and joins the server threads (5 s max each).
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.server
import itertools
import json
import os
import re
import shutil
import socket
import struct
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping
from urllib.parse import parse_qs, quote, unquote, urlsplit

HEX40 = re.compile(r"[0-9a-f]{40}")
_SUBPATHS = {"revision", "tree", "refs", "commits", "paths-info", "resolve", "discussions", "blob", "raw"}
_EPOCH = 1_704_067_200  # 2024-01-01T00:00:00Z: synthetic commit dates count seconds from here
_MAX_REQUEST_BODY = 1 << 20

#: What a fresh Hub repo's .gitattributes sends to LFS (subset). Pass as ``lfs_patterns`` to mimic it.
HF_DEFAULT_LFS_PATTERNS = (
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.model",
    "*.pkl", "*.npy", "*.npz", "*.tar", "*.zip", "*.gz", "*.arrow", "*.parquet",
)


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as ETag / oid of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + ".000Z"


@dataclass(frozen=True)
class RequestRecord:
    method: str
    path: str  # raw request target, query included
    range: str | None  # the Range request header
    status: int
    bytes_sent: int  # body bytes actually written
    repo_id: str | None = None
    filename: str | None = None
    revision: str | None = None  # as requested (decoded)
    commit: str | None = None  # what it resolved to
    client: str = ""
    origin: str = "hub"  # "hub" or "cdn" (the listener that answered)
    cut: bool = False  # the connection was cut by a fault knob
    corrupted: bool = False  # body bytes were flipped by corrupt_next()
    headers: Mapping[str, str] = field(default_factory=dict)  # request headers, lower-cased names
    arrived: int = 0  # the order the server began answering it in: a record is kept once its answer is sent, and
    # a short answer on the other listener (the redirect's target) can be sent before the redirect's own finishes


@dataclass
class _Commit:
    sha: str
    folder: Path
    parent: str | None
    title: str
    date: float


@dataclass
class _Repo:
    repo_id: str
    commits: dict[str, _Commit] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch / "refs/pr/N" -> sha
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class _Cut:
    after: int
    remaining: int | None  # None: forever
    pattern: str | None
    mode: str


@dataclass
class _Corrupt:
    remaining: int | None  # None: forever
    pattern: str | None
    nbytes: int


@dataclass
class _Fail:
    status: int
    remaining: int | None
    pattern: str | None
    methods: tuple[str, ...]
    retry_after: float | None
    ranged: bool | None = None


@dataclass
class _Trigger:
    predicate: Callable[[RequestRecord], bool]
    action: Callable[[], object]


class _HttpError(Exception):
    def __init__(self, status: int, code: str | None, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, dict(headers or {})


class _Listener(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, hub: "HubServer", origin: str):
        self.hub, self.origin = hub, origin
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request, client_address):
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_all_connections(self):
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address):  # quiet on the client going away / timeouts
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError, OSError)):
            return
        super().handle_error(request, client_address)


class HubServer:
    """Fake Hub over loopback. See the module docstring for the protocol, knobs and counters."""

    HF_DEFAULT_LFS_PATTERNS = HF_DEFAULT_LFS_PATTERNS

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        large_threshold: int = 1_000_000,
        lfs_patterns: tuple[str, ...] = (),
        redirect_large: bool | str = False,
        timeout: float = 10.0,
        tree_page_size: int = 1000,
    ):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.large_threshold = large_threshold
        self.lfs_patterns = tuple(lfs_patterns)
        self.redirect_large = redirect_large
        self.timeout = timeout
        self.tree_page_size = tree_page_size
        # knobs (plain attributes, read at each request)
        #: cap on file-body bytes/s per response (None: unthrottled); sleeps <= 0.25 s at a time
        self.throttle_bytes_per_s: float | None = None
        #: cut EVERY file GET after this many body bytes (None: off); one-shot cuts: cut_next()
        self.cut_after_bytes: int | None = None
        #: sleep this long (capped at ``timeout``) before answering any request
        self.latency_s: float = 0.0
        self.size_overrides: dict[tuple[str, str], int] = {}
        self._etag_overrides: dict[tuple[str, str], tuple[str, str | None]] = {}  # (commit, path) -> (etag, sha256)
        self._cuts: list[_Cut] = []
        self._fails: list[_Fail] = []
        self._corrupts: list[_Corrupt] = []
        self._triggers: list[_Trigger] = []
        # state
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._arrivals = itertools.count(1)
        self._repos: dict[str, _Repo] = {}
        self._hash_cache: dict[tuple, tuple[str, str | None]] = {}
        self._records: list[RequestRecord] = []
        self.errors: list[str] = []  # tracebacks of bugs in this fake (answered 500); tests may assert it stays empty
        self._bytes_by_file: dict[tuple[str, str], int] = {}
        self._bytes_by_client: dict[str, int] = {}
        self._bytes_total = 0
        self._clock = 0
        self._listeners: list[_Listener] = []
        self._threads: list[threading.Thread] = []
        self._load_existing()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HubServer":
        if self._listeners:
            return self
        for origin in ("hub", "cdn"):
            listener = _Listener(self, origin)
            thread = threading.Thread(
                target=listener.serve_forever, kwargs={"poll_interval": 0.05}, name=f"hub-server-{origin}", daemon=True
            )
            thread.start()
            self._listeners.append(listener)
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        listeners, threads = self._listeners, self._threads
        self._listeners, self._threads = [], []
        for listener in listeners:
            listener.shutdown()
            listener.server_close()
            listener.close_all_connections()
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The Hub endpoint (what HF_ENDPOINT should be)."""
        return self._base(0)

    @property
    def cdn_url(self) -> str:
        """The second listener: the "CDN" origin large files are redirected to with redirect_large="cross"."""
        return self._base(1)

    def _base(self, i: int) -> str:
        if not self._listeners:
            raise RuntimeError("HubServer is not running (use `with server:` or server.start())")
        host, port = self._listeners[i].server_address[:2]
        return f"http://{host}:{port}"

    def subprocess_env(self, hf_home: str | os.PathLike, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a child process whose huggingface_hub/transformers must talk to this server."""
        env = dict(os.environ if base is None else base)
        for key in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HF_ASSETS_CACHE", "HF_TOKEN_PATH",
                    "TRANSFORMERS_CACHE", "HF_XET_CACHE", "HF_HUB_ENABLE_HF_TRANSFER"):
            env.pop(key, None)
        no_proxy = ",".join(x for x in (env.get("NO_PROXY") or env.get("no_proxy"), "127.0.0.1", "localhost") if x)
        env.update(
            HF_ENDPOINT=self.url,
            HF_HOME=str(hf_home),
            HF_HUB_OFFLINE="0",
            TRANSFORMERS_OFFLINE="0",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            NO_PROXY=no_proxy,
            no_proxy=no_proxy,
        )
        return env

    # ------------------------------------------------------------------ repos
    def add_repo(self, repo_id: str, source: str | os.PathLike | Mapping[str, bytes | str], *,
                 branch: str = "main", title: str | None = None, link: bool = False) -> str:
        """Create (or move ``branch`` of) ``repo_id`` to a commit holding exactly ``source``'s files.

        ``source``: a folder (copied; ``link=True`` hard-links instead when possible) or ``{path: bytes|str}``.
        Returns the commit sha, deterministic in (repo_id, parent commit, title, file paths and contents).
        """
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo(repo_id))
            parent = repo.refs.get(branch) or repo.refs.get("main")
        sha = self._commit(repo_id, source, parent=parent, title=title or f"Update {branch}", link=link)
        with self._lock:
            repo.refs[branch] = sha
            self._save_refs(repo)
        return sha

    def add_revision(self, repo_id: str, branch: str, source: str | os.PathLike | Mapping[str, bytes | str], *,
                     title: str | None = None, link: bool = False) -> str:
        """A new commit (full snapshot of ``source``) at the head of ``branch`` (created from main if new);
        ``branch`` may be e.g. ``"dev"`` or ``"refs/pr/1"``. Returns its sha (distinct from the parent's, even for
        identical contents)."""
        if repo_id not in self._repos:
            raise KeyError(f"unknown repo {repo_id!r}: add_repo() it first")
        return self.add_repo(repo_id, source, branch=branch, title=title, link=link)

    def update_files(self, repo_id: str, changes: Mapping[str, bytes | str | None], *, branch: str = "main",
                     title: str | None = None) -> str:
        """A new commit on ``branch`` = its head plus ``changes`` (``None`` deletes a path). Returns the sha."""
        head = self._resolve(repo_id, branch)
        staged = self._stage_dir()
        shutil.copytree(head.folder, staged, dirs_exist_ok=True, copy_function=_link_or_copy)
        for path, data in changes.items():
            target = staged / path
            if data is None:
                target.unlink(missing_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)  # never write through a hard link
            target.write_bytes(data.encode() if isinstance(data, str) else data)
        sha = self._commit(repo_id, staged, parent=head.sha, title=title or f"Update {', '.join(changes)}",
                           staged=True)
        with self._lock:
            repo = self._repos[repo_id]
            repo.refs[branch] = sha
            self._save_refs(repo)
        return sha

    def add_tag(self, repo_id: str, tag: str, revision: str = "main") -> str:
        sha = self._resolve(repo_id, revision).sha
        with self._lock:
            repo = self._repos[repo_id]
            repo.tags[tag] = sha
            self._save_refs(repo)
        return sha

    def commit_sha(self, repo_id: str, revision: str = "main") -> str:
        return self._resolve(repo_id, revision).sha

    def file_path(self, repo_id: str, path: str, revision: str = "main") -> Path:
        """Where the server reads ``path`` of ``repo_id@revision`` from."""
        return self._resolve(repo_id, revision).folder / path

    def file_etag(self, repo_id: str, path: str, revision: str = "main") -> str:
        """The (unquoted) ETag the client will cache the file under: sha256 if large, git blob sha1 otherwise."""
        commit = self._resolve(repo_id, revision)
        return self._file_meta(commit, path)["etag"]

    def is_large(self, path: str, size: int) -> bool:
        name = path.rsplit("/", 1)[-1]
        return size > self.large_threshold or any(fnmatch.fnmatch(name, p) for p in self.lfs_patterns)

    def _stage_dir(self) -> Path:
        staged = self.root / ".staging" / uuid.uuid4().hex
        staged.mkdir(parents=True)
        return staged

    def _commit(self, repo_id, source, *, parent, title, link=False, staged=False) -> str:
        if not staged:
            dest = self._stage_dir()
            if isinstance(source, Mapping):
                for path, data in source.items():
                    (dest / path).parent.mkdir(parents=True, exist_ok=True)
                    (dest / path).write_bytes(data.encode() if isinstance(data, str) else data)
            else:
                shutil.copytree(source, dest, dirs_exist_ok=True,
                                copy_function=_link_or_copy if link else shutil.copy2)
            source = dest
        staged_dir = Path(source)
        h = hashlib.sha1(f"{repo_id}\n{parent}\n{title}\n".encode())
        for rel in sorted(_walk_files(staged_dir)):
            h.update(f"{rel} {git_blob_sha1((staged_dir / rel).read_bytes())}\n".encode())
        sha = h.hexdigest()
        folder = self.root / repo_id / sha
        with self._lock:
            if folder.exists():
                shutil.rmtree(staged_dir, ignore_errors=True)
            else:
                folder.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staged_dir, folder)
            repo = self._repos.setdefault(repo_id, _Repo(repo_id))
            if sha not in repo.commits:
                self._clock += 1
                repo.commits[sha] = _Commit(sha, folder, parent, title, _EPOCH + self._clock)
        return sha

    def _save_refs(self, repo: _Repo) -> None:
        meta = {
            "refs": repo.refs,
            "tags": repo.tags,
            "commits": {c.sha: {"parent": c.parent, "title": c.title, "date": c.date} for c in repo.commits.values()},
        }
        (self.root / repo.repo_id).mkdir(parents=True, exist_ok=True)
        (self.root / repo.repo_id / "refs.json").write_text(json.dumps(meta, indent=1))

    def _load_existing(self) -> None:
        """Pick up ``root/<org>/<name>/<sha or branch>/`` folders left by a previous server (or generated)."""
        for org in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for name in sorted(p for p in org.iterdir() if p.is_dir()):
                repo_id = f"{org.name}/{name.name}"
                meta_file = name / "refs.json"
                meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
                repo = _Repo(repo_id, refs=dict(meta.get("refs", {})), tags=dict(meta.get("tags", {})))
                for sub in sorted(p for p in name.iterdir() if p.is_dir()):
                    info = meta.get("commits", {}).get(sub.name)
                    if HEX40.fullmatch(sub.name):
                        info = info or {"parent": None, "title": "Imported", "date": _EPOCH}
                        repo.commits[sub.name] = _Commit(sub.name, sub, info["parent"], info["title"], info["date"])
                    else:  # a folder named by a branch: synthetic sha from its contents
                        h = hashlib.sha1(f"{repo_id}\n{sub.name}\n".encode())
                        for rel in sorted(_walk_files(sub)):
                            h.update(f"{rel} {git_blob_sha1((sub / rel).read_bytes())}\n".encode())
                        sha = h.hexdigest()
                        repo.commits[sha] = _Commit(sha, sub, None, f"Imported {sub.name}", _EPOCH)
                        repo.refs.setdefault(unquote(sub.name), sha)
                if repo.commits:
                    if "main" not in repo.refs:
                        repo.refs["main"] = next(iter(repo.commits))
                    self._repos[repo_id] = repo

    def _resolve(self, repo_id: str, revision: str | None) -> _Commit:
        with self._lock:
            repo = self._repos.get(repo_id)
            if repo is None:
                raise _HttpError(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}.")
            revision = revision or "main"
            sha = repo.refs.get(revision) or repo.tags.get(revision)
            if sha is None and HEX40.fullmatch(revision) and revision in repo.commits:
                sha = revision
            if sha is None:
                raise _HttpError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return repo.commits[sha]

    # ------------------------------------------------------------------ file metadata
    def _hashes(self, path: Path, large: bool) -> tuple[str, str | None]:
        """(git blob sha1, sha256 if large) of a file, cached on (path, inode, size, mtime)."""
        st = path.stat()
        key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns, large)
        with self._lock:
            hit = self._hash_cache.get(key)
        if hit:
            return hit
        sha1 = hashlib.sha1(b"blob %d\0" % st.st_size)
        sha256 = hashlib.sha256() if large else None
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                sha1.update(chunk)
                if sha256 is not None:
                    sha256.update(chunk)
        value = (sha1.hexdigest(), sha256.hexdigest() if sha256 else None)
        with self._lock:
            self._hash_cache[key] = value
        return value

    def _file_meta(self, commit: _Commit, path: str) -> dict:
        """Everything the protocol says about one file; raises EntryNotFound (with the commit) if absent."""
        full = commit.folder / path
        if not _safe_rel(path) or not full.is_file():
            raise _HttpError(404, "EntryNotFound", f"{path} does not exist on \"{commit.sha}\"",
                             {"X-Repo-Commit": commit.sha})
        size = full.stat().st_size
        large = self.is_large(path, size)
        blob_sha1, sha256 = self._hashes(full, large)
        repo_id = commit.folder.parent.relative_to(self.root).as_posix()
        override = self._etag_overrides.get((commit.sha, path))
        if override is not None:
            blob_sha1, sha256 = override[0], override[1] or sha256
        advertised = self.size_overrides.get((repo_id, path), size)
        meta = {"path": path, "full": full, "size": size, "advertised_size": advertised, "large": large,
                "blob_sha1": blob_sha1, "sha256": sha256, "etag": sha256 if large else blob_sha1}
        if large:
            pointer = lfs_pointer(sha256, advertised)
            meta["pointer_size"] = len(pointer)
            meta["oid"] = git_blob_sha1(pointer)
        else:
            meta["oid"] = blob_sha1
        return meta

    def _tree_entry(self, commit: _Commit, path: str, expand: bool = False) -> dict:
        full = commit.folder / path
        if full.is_dir():
            entry = {"type": "directory", "oid": self._dir_oid(commit, path), "size": 0, "path": path}
        else:
            meta = self._file_meta(commit, path)
            entry = {"type": "file", "oid": meta["oid"], "size": meta["advertised_size"], "path": path}
            if meta["large"]:
                entry["lfs"] = {"oid": meta["sha256"], "size": meta["advertised_size"],
                                "pointerSize": meta["pointer_size"]}
        if expand:
            entry["lastCommit"] = {"id": commit.sha, "title": commit.title, "date": _iso(commit.date)}
        return entry

    def _dir_oid(self, commit: _Commit, path: str) -> str:
        h = hashlib.sha1(b"tree\0")
        base = commit.folder / path
        for rel in sorted(_walk_files(base)):
            h.update(f"{rel} {self._file_meta(commit, f'{path}/{rel}' if path else rel)['oid']}\n".encode())
        return h.hexdigest()

    # ------------------------------------------------------------------ knobs
    def cut_next(self, after_bytes: int, count: int | None = 1, *, path: str | None = None,
                 mode: str = "close") -> None:
        """Cut the next ``count`` GET bodies (``None``: all of them until ``clear_faults()``) after ``after_bytes``
        body bytes. ``path``: only files matching this fnmatch pattern (repo file name, e.g. ``"*.safetensors"``).
        ``mode="close"``: clean FIN (the client sees a short body: httpx ``RemoteProtocolError``, which
        ``hf_hub_download`` retries after a 1 s sleep, resuming with ``Range: bytes=<k * 10 MiB>-`` from the last
        COMPLETE ``DOWNLOAD_CHUNK_SIZE`` chunk it wrote -- so files under 10 MiB start over from byte 0);
        ``mode="reset"``: TCP RST (httpx ``ReadError``: ``hf_hub_download`` does NOT retry it and raises)."""
        if mode not in ("close", "reset"):
            raise ValueError(mode)
        with self._lock:
            self._cuts.append(_Cut(after_bytes, count, path, mode))

    def fail_next(self, status: int = 503, count: int | None = 1, *, path: str | None = None,
                  methods: tuple[str, ...] = ("GET", "HEAD"), retry_after: float | None = None,
                  ranged: bool | None = None) -> None:
        """Answer the next ``count`` matching resolve/CDN requests with ``status`` (JSON error body).
        ``path`` as in ``cut_next``; ``retry_after`` adds a ``Retry-After`` header (seconds); ``ranged``: only
        requests with (True) or without (False, what ``hf_hub_download`` sends first) a ``Range`` header."""
        with self._lock:
            self._fails.append(_Fail(status, count, path, tuple(m.upper() for m in methods), retry_after, ranged))

    def corrupt_next(self, count: int | None = 1, *, path: str | None = None, nbytes: int = 16) -> None:
        """Flip (XOR 0xFF) ``nbytes`` bytes in the middle of the next ``count`` whole-file GET bodies (no ``Range``
        header: what ``hf_hub_download`` sends; ranged reads are left alone) of files matching ``path`` (as in
        ``cut_next``; ``count=None``: every one until ``clear_faults()``). Length, ETag and every header stay those
        of the true file: a download corrupted in transit. ``RequestRecord.corrupted`` marks the responses."""
        if nbytes < 1:
            raise ValueError(nbytes)
        with self._lock:
            self._corrupts.append(_Corrupt(count, path, nbytes))

    def replace_file(self, repo_id: str, path: str, data: bytes | str | None, *, revision: str = "main",
                     keep_etag: bool = False, new_commit: bool = False,
                     when: str | Callable[[RequestRecord], bool] | None = None) -> None:
        """Change what the server serves for ``path`` (``data=None`` deletes it), to test "the remote changed".

        ``new_commit=False`` (default) rewrites the file inside the commit ``revision`` resolves to (the same sha now
        serves other bytes: what a client sees if a CDN/mirror is inconsistent, or if it planned from metadata and
        the content moved under it). ``keep_etag=True`` keeps advertising the old ETag/sha256 for it (a server
        lying about content). ``new_commit=True`` instead makes a new commit on branch ``revision`` (the honest Hub
        behaviour: ``main`` moves, the old sha keeps the old bytes).
        ``when``: ``None`` = now; ``"head"`` = right after the server answered the next HEAD of this file (i.e. after
        hf_hub_download planned, before it GETs); ``"api"`` = after the next /api/ request on this repo; or a
        predicate on the ``RequestRecord`` of each request (fires once, after that request's response was decided,
        before it is written)."""
        def action():
            if new_commit:
                self.update_files(repo_id, {path: data}, branch=revision)
                return
            commit = self._resolve(repo_id, revision)
            target = commit.folder / path
            with self._lock:
                if keep_etag and target.is_file():
                    meta = self._file_meta(commit, path)
                    self._etag_overrides[(commit.sha, path)] = (meta["blob_sha1"], meta["sha256"])
                elif not keep_etag:
                    self._etag_overrides.pop((commit.sha, path), None)
                if data is None:
                    target.unlink(missing_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    tmp = target.with_name(target.name + f".{uuid.uuid4().hex}.tmp")
                    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
                    os.replace(tmp, target)  # a response already streaming keeps the old inode

        if when is None:
            action()
            return
        if when == "head":
            def predicate(r):
                return r.method == "HEAD" and r.repo_id == repo_id and r.filename == path
        elif when == "api":
            def predicate(r):
                return r.repo_id == repo_id and r.path.startswith("/api/")
        elif callable(when):
            predicate = when
        else:
            raise ValueError(f"when={when!r}")
        with self._lock:
            self._triggers.append(_Trigger(predicate, action))

    def override_size(self, repo_id: str, path: str, size: int | None) -> None:
        """Advertise ``size`` for ``path`` (all revisions) in HEAD (``Content-Length`` of small files,
        ``X-Linked-Size``) and the API (tree, paths-info, model_info): a lying server. GET bodies are unchanged
        (their Content-Length stays true, so HTTP framing holds). ``None`` removes the override."""
        with self._lock:
            if size is None:
                self.size_overrides.pop((repo_id, path), None)
            else:
                self.size_overrides[(repo_id, path)] = size

    def clear_faults(self) -> None:
        """Remove cuts, failures, pending triggers, throttling, latency and size overrides (not file changes)."""
        with self._lock:
            self._cuts.clear()
            self._fails.clear()
            self._corrupts.clear()
            self._triggers.clear()
            self.size_overrides.clear()
            self.throttle_bytes_per_s = None
            self.cut_after_bytes = None
            self.latency_s = 0.0

    def _take(self, faults: list, filename: str | None, method: str | None = None, ranged: bool | None = None):
        with self._lock:
            for fault in faults:
                if fault.remaining is not None and fault.remaining <= 0:
                    continue
                if getattr(fault, "ranged", None) is not None and fault.ranged != ranged:
                    continue
                if fault.pattern is not None and not (filename and fnmatch.fnmatch(filename, fault.pattern)):
                    continue
                if method is not None and method not in fault.methods:
                    continue
                if fault.remaining is not None:
                    fault.remaining -= 1
                return fault
        return None

    def _fire_triggers(self, record: RequestRecord) -> None:
        with self._lock:
            fired = [t for t in self._triggers if t.predicate(record)]
            self._triggers = [t for t in self._triggers if t not in fired]
        for trigger in fired:
            trigger.action()

    # ------------------------------------------------------------------ accounting
    @contextlib.contextmanager
    def _inflight_request(self) -> Iterator[None]:
        with self._lock:
            self._inflight += 1
        try:
            yield
        finally:
            with self._lock:
                self._inflight -= 1
                self._idle.notify_all()

    def _record(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)
            self._bytes_total += record.bytes_sent
            if record.repo_id and record.filename:
                key = (record.repo_id, record.filename)
                self._bytes_by_file[key] = self._bytes_by_file.get(key, 0) + record.bytes_sent
            self._bytes_by_client[record.client] = self._bytes_by_client.get(record.client, 0) + record.bytes_sent

    def settle(self, timeout: float = 2.0) -> bool:
        """Wait (bounded) until no request is being answered; True if idle."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    @property
    def requests(self) -> list[RequestRecord]:
        """Every request answered since the last ``reset_counters``, in the order they arrived."""
        self.settle()
        with self._lock:
            return sorted(self._records, key=lambda r: r.arrived)

    @property
    def bytes_sent(self) -> int:
        self.settle()
        with self._lock:
            return self._bytes_total

    @property
    def bytes_by_file(self) -> dict[tuple[str, str], int]:
        self.settle()
        with self._lock:
            return dict(self._bytes_by_file)

    @property
    def bytes_by_client(self) -> dict[str, int]:
        self.settle()
        with self._lock:
            return dict(self._bytes_by_client)

    def bytes_for(self, repo_id: str, filename: str | None = None) -> int:
        return sum(n for (r, f), n in self.bytes_by_file.items() if r == repo_id and filename in (None, f))

    def requests_for(self, filename: str | None = None, method: str | None = None) -> list[RequestRecord]:
        return [r for r in self.requests if filename in (None, r.filename) and method in (None, r.method)]

    def reset_counters(self) -> None:
        self.settle()
        with self._lock:
            self._records.clear()
            self._bytes_by_file.clear()
            self._bytes_by_client.clear()
            self._bytes_total = 0


def _safe_rel(path: str) -> bool:
    """A repo-relative posix path that cannot escape the commit folder."""
    return bool(path) and not path.startswith("/") and "\\" not in path and all(
        seg not in ("", ".", "..") for seg in path.split("/"))


def _walk_files(base: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            out.append((Path(dirpath) / name).relative_to(base).as_posix())
    return out


def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` -> inclusive (start, end); None if unsatisfiable/unsupported."""
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header)
    if not m or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):  # suffix
        n = int(m.group(2))
        if n == 0 or size == 0:
            return None
        return max(0, size - n), size - 1
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if start >= size or end < start:
        return None
    return start, min(end, size - 1)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Listener
    server_version = "FakeHub/1.0"

    def setup(self):
        self.timeout = self.server.hub.timeout
        super().setup()
        # headers and body go out in separate writes: without this, Nagle + delayed ACK add 40 ms per response
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args):  # silence
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    def do_HEAD(self):
        self._dispatch()

    def do_GET(self):
        self._dispatch()

    def do_POST(self):
        self._dispatch()

    # ------------------------------------------------------------------ plumbing
    def _dispatch(self):
        with self.hub._inflight_request():
            self._ctx = {"repo_id": None, "filename": None, "revision": None, "commit": None}
            self._arrived = next(self.hub._arrivals)
            self._sent = 0
            self._cut = False
            self._corrupted = False
            self._status = 0
            try:
                if self.hub.latency_s:
                    time.sleep(min(self.hub.latency_s, self.hub.timeout))
                self._route()
            except _HttpError as e:
                if self._status:  # headers already out: nothing sane left to send
                    self.close_connection = True
                else:
                    self._send_error(e)
            except (ConnectionError, TimeoutError, OSError):
                self.close_connection = True
            except Exception as e:  # a bug in the fake: answer 500, keep it for the tests to see
                self.hub.errors.append(traceback.format_exc())
                self.close_connection = True
                if not self._status:
                    with contextlib.suppress(OSError):
                        self._send_error(_HttpError(500, None, f"fake hub bug: {e!r}"))
            finally:
                if self._status:
                    self.hub._record(self._make_record())

    def _make_record(self) -> RequestRecord:
        headers = {k.lower(): v for k, v in self.headers.items()}
        return RequestRecord(
            method=self.command, path=self.path, range=self.headers.get("Range"), status=self._status,
            bytes_sent=self._sent, client=self.headers.get("X-Client-Id") or self.client_address[0],
            origin=self.server.origin, cut=self._cut, corrupted=self._corrupted, headers=headers, arrived=self._arrived,
            **self._ctx,
        )

    def _start(self, status: int, headers: Mapping[str, str]) -> None:
        """Send status + headers (body, if any, follows). Fires the replace_file() triggers first."""
        self._status = status
        self.hub._fire_triggers(self._make_record())
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, str(value))
        self.end_headers()

    def _send_bytes(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        headers = {"Content-Length": str(len(body)), **(headers or {})}
        self._start(status, headers)
        if self.command != "HEAD" and body:
            self.wfile.write(body)
            self._sent += len(body)

    def _send_json(self, obj, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self._send_bytes(status, body, {"Content-Type": "application/json; charset=utf-8", **(headers or {})})

    def _send_error(self, e: _HttpError) -> None:
        headers = dict(e.headers)
        if e.code:
            headers["X-Error-Code"] = e.code
        headers["X-Error-Message"] = e.message.encode("ascii", "replace").decode()
        self._send_json({"error": e.message}, e.status, headers)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > _MAX_REQUEST_BODY:
            self.close_connection = True
            raise _HttpError(413, None, "request body too large")
        return self.rfile.read(length) if length else b""

    # ------------------------------------------------------------------ routing
    def _route(self):
        split = urlsplit(self.path)
        raw = split.path
        query = parse_qs(split.query)
        segs = raw.strip("/").split("/") if raw.strip("/") else []
        if segs and segs[0] == "cdn":
            return self._serve_cdn(segs[1:])
        if self.server.origin == "cdn":
            raise _HttpError(404, None, "Not Found")
        if segs[:2] == ["api", "agent-harnesses"]:
            return self._send_json({"standardEnvVars": [], "harnesses": {}})
        if segs[:1] == ["api"] and len(segs) >= 3:
            if segs[1] != "models":
                raise _HttpError(404, "RepoNotFound", f"Repository type {segs[1]!r} is not served by this fake Hub")
            return self._route_api(segs[2:], query)
        if "resolve" in segs[1:3]:
            i = segs.index("resolve", 1)
            if segs[0] in ("datasets", "spaces", "kernels"):
                raise _HttpError(404, "RepoNotFound", "Only model repos are served by this fake Hub")
            if len(segs) < i + 3:
                raise _HttpError(404, "EntryNotFound", "no file in url")
            repo_id = "/".join(unquote(s) for s in segs[:i])
            revision = unquote(segs[i + 1])
            filename = "/".join(unquote(s) for s in segs[i + 2:])
            return self._serve_resolve(repo_id, revision, filename)
        raise _HttpError(404, None, "Not Found")

    def _split_repo(self, segs: list[str]) -> tuple[str, list[str]]:
        known = self.hub._repos
        two = "/".join(unquote(s) for s in segs[:2])
        if len(segs) >= 2 and (two in known or segs[1] not in _SUBPATHS):
            return two, segs[2:]
        return unquote(segs[0]), segs[1:]

    def _route_api(self, segs: list[str], query: dict):
        repo_id, rest = self._split_repo(segs)
        self._ctx["repo_id"] = repo_id
        op = rest[0] if rest else None
        if self.command == "POST":
            if op != "paths-info" or len(rest) < 2:
                raise _HttpError(404, None, "Not Found")
            return self._paths_info(repo_id, unquote("/".join(rest[1:])))
        if op is None:
            return self._model_info(repo_id, None, query)
        if op == "revision" and len(rest) >= 2:
            return self._model_info(repo_id, unquote("/".join(rest[1:])), query)
        if op == "tree" and len(rest) >= 2:
            revision = unquote(rest[1])
            path = "/".join(unquote(s) for s in rest[2:]).strip("/")
            return self._tree(repo_id, revision, path, query)
        if op == "refs":
            return self._refs(repo_id)
        if op == "commits" and len(rest) >= 2:
            return self._commits(repo_id, unquote("/".join(rest[1:])))
        self.hub._resolve(repo_id, None)  # RepoNotFound first
        raise _HttpError(404, None, "Not Found")

    # ------------------------------------------------------------------ API
    def _model_info(self, repo_id: str, revision: str | None, query: dict):
        self._ctx["revision"] = revision
        commit = self.hub._resolve(repo_id, revision)
        self._ctx["commit"] = commit.sha
        blobs = (query.get("blobs") or ["false"])[0].lower() in ("1", "true")
        siblings, used = [], 0
        for rel in sorted(_walk_files(commit.folder)):
            sibling = {"rfilename": rel}
            if blobs:
                meta = self.hub._file_meta(commit, rel)
                sibling.update(size=meta["advertised_size"], blobId=meta["oid"])
                if meta["large"]:
                    sibling["lfs"] = {"sha256": meta["sha256"], "size": meta["advertised_size"],
                                      "pointerSize": meta["pointer_size"]}
            used += (commit.folder / rel).stat().st_size
            siblings.append(sibling)
        author = repo_id.split("/")[0] if "/" in repo_id else None
        self._send_json({
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": author, "sha": commit.sha, "lastModified": _iso(commit.date), "createdAt": _iso(_EPOCH),
            "private": False, "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
            "library_name": "transformers" if (commit.folder / "config.json").exists() else None,
            "siblings": siblings, "spaces": [], "usedStorage": used,
        })

    def _tree(self, repo_id: str, revision: str, path: str, query: dict):
        self._ctx["revision"] = revision
        commit = self.hub._resolve(repo_id, revision)
        self._ctx["commit"] = commit.sha
        base = commit.folder / path
        if path and (not _safe_rel(path) or not base.exists()):
            raise _HttpError(404, "EntryNotFound", f"{path} does not exist on \"{commit.sha}\"")
        recursive = (query.get("recursive") or ["false"])[0].lower() in ("1", "true")
        expand = (query.get("expand") or ["false"])[0].lower() in ("1", "true")
        if base.is_file():
            paths = [path]
        else:
            paths = []
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = sorted(d for d in dirnames if d != ".git")
                rel_dir = Path(dirpath).relative_to(commit.folder).as_posix()
                prefix = "" if rel_dir == "." else rel_dir + "/"
                paths += [prefix + d for d in dirnames] + [prefix + f for f in sorted(filenames)]
                if not recursive:
                    break
        try:
            cursor = int((query.get("cursor") or ["0"])[0])
        except ValueError:
            raise _HttpError(400, None, "bad cursor") from None
        page_size = max(1, int(self.hub.tree_page_size))
        page = [self.hub._tree_entry(commit, p, expand) for p in paths[cursor:cursor + page_size]]
        headers = {}
        if cursor + page_size < len(paths):
            params = {k: v[0] for k, v in query.items()}
            params["cursor"] = str(cursor + page_size)
            qs = "&".join(f"{quote(k)}={quote(v)}" for k, v in params.items())
            host = self.headers.get("Host") or "127.0.0.1"
            headers["Link"] = f'<http://{host}{urlsplit(self.path).path}?{qs}>; rel="next"'
        self._send_json(page, headers=headers)

    def _paths_info(self, repo_id: str, revision: str):
        self._ctx["revision"] = revision
        commit = self.hub._resolve(repo_id, revision)
        self._ctx["commit"] = commit.sha
        body = self._read_body()
        ctype = self.headers.get("Content-Type", "")
        if "json" in ctype:
            data = json.loads(body or b"{}")
            paths, expand = data.get("paths", []), bool(data.get("expand"))
        else:
            form = parse_qs(body.decode(), keep_blank_values=True)
            paths = form.get("paths", [])
            expand = (form.get("expand") or ["false"])[0].lower() in ("1", "true")
        if isinstance(paths, str):
            paths = [paths]
        out = []
        for p in paths:
            p = p.strip("/")
            if _safe_rel(p) and (commit.folder / p).exists():
                out.append(self.hub._tree_entry(commit, p, expand))
        self._send_json(out)

    def _refs(self, repo_id: str):
        self.hub._resolve(repo_id, None)
        repo = self.hub._repos[repo_id]

        def ref(name, kind):
            return {"name": name, "ref": f"refs/{kind}/{name}", "targetCommit": sha}

        branches, prs = [], []
        for name, sha in sorted(repo.refs.items()):
            if name.startswith("refs/pr/"):
                prs.append({"name": name, "ref": name, "targetCommit": sha})
            else:
                branches.append(ref(name, "heads"))
        tags = [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": s} for n, s in sorted(repo.tags.items())]
        self._send_json({"branches": branches, "converts": [], "tags": tags, "pullRequests": prs})

    def _commits(self, repo_id: str, revision: str):
        commit = self.hub._resolve(repo_id, revision)
        repo = self.hub._repos[repo_id]
        out = []
        while commit is not None:
            out.append({"id": commit.sha, "title": commit.title, "message": "", "authors": [{"user": "fake-hub"}],
                        "date": _iso(commit.date)})
            commit = repo.commits.get(commit.parent) if commit.parent else None
        self._send_json(out)

    # ------------------------------------------------------------------ files
    def _check_fail(self, filename: str | None):
        fail = self.hub._take(self.hub._fails, filename, self.command, ranged=self.headers.get("Range") is not None)
        if fail is not None:
            headers = {} if fail.retry_after is None else {"Retry-After": str(fail.retry_after)}
            raise _HttpError(fail.status, None, f"injected failure {fail.status}", headers)

    def _serve_resolve(self, repo_id: str, revision: str, filename: str):
        self._ctx.update(repo_id=repo_id, revision=revision, filename=filename)
        commit = self.hub._resolve(repo_id, revision)
        self._ctx["commit"] = commit.sha
        meta = self.hub._file_meta(commit, filename)
        self._check_fail(filename)
        hub_headers = {"X-Repo-Commit": commit.sha}
        if meta["large"]:
            hub_headers["X-Linked-Etag"] = f'"{meta["sha256"]}"'
            hub_headers["X-Linked-Size"] = str(meta["advertised_size"])
        mode = self.hub.redirect_large
        if meta["large"] and mode:
            base = self.hub.url if mode == "same" else self.hub.cdn_url
            location = f"{base}/cdn/{quote(repo_id)}/{commit.sha}/{quote(filename)}"
            return self._send_bytes(302, b"", {**hub_headers, "ETag": f'"{meta["oid"]}"', "Location": location})
        self._serve_file(meta, {**hub_headers, "ETag": f'"{meta["etag"]}"'})

    def _serve_cdn(self, segs: list[str]):
        # /cdn/<org>/<name>/<sha>/<path...>
        if len(segs) < 4 or not HEX40.fullmatch(segs[2]):
            raise _HttpError(404, None, "NoSuchKey")
        repo_id, sha = f"{unquote(segs[0])}/{unquote(segs[1])}", segs[2]
        filename = "/".join(unquote(s) for s in segs[3:])
        self._ctx.update(repo_id=repo_id, revision=sha, commit=sha, filename=filename)
        try:
            commit = self.hub._resolve(repo_id, sha)
            meta = self.hub._file_meta(commit, filename)
        except _HttpError:
            raise _HttpError(404, None, "NoSuchKey") from None
        self._check_fail(filename)
        name = filename.rsplit("/", 1)[-1]
        ascii_name = name.encode("ascii", "replace").decode().replace('"', "_")
        headers = {
            "ETag": f'"{meta["sha256"] or meta["blob_sha1"]}"',
            "Content-Disposition": f"inline; filename*=UTF-8''{quote(name)}; filename=\"{ascii_name}\";",
        }
        if self.hub.redirect_large == "same":  # the client reads the HEAD metadata from this very response
            headers.update({"X-Repo-Commit": commit.sha, "X-Linked-Etag": f'"{meta["sha256"]}"',
                            "X-Linked-Size": str(meta["advertised_size"])})
        self._serve_file(meta, headers)

    def _serve_file(self, meta: dict, headers: dict):
        full: Path = meta["full"]
        f = open(full, "rb")  # opened before any trigger can swap the file: this response is consistent
        try:
            size = os.fstat(f.fileno()).st_size
            headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", **headers}
            range_header = self.headers.get("Range")
            if range_header is not None:
                span = _parse_range(range_header, size)
                if span is None:
                    raise _HttpError(416, None, f"Range Not Satisfiable: {range_header}",
                                     {"Content-Range": f"bytes */{size}", "Accept-Ranges": "bytes"})
                start, end = span
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            else:
                start, end, status = 0, size - 1, 200
            length = end - start + 1 if size else 0
            if self.command == "HEAD" and range_header is None and not (
                    "X-Linked-Size" in headers or meta["large"]):
                length_header = meta["advertised_size"]  # small files: the size comes from Content-Length
            else:
                length_header = length
            headers["Content-Length"] = str(length_header)
            cut = corrupt = None
            if self.command == "GET":
                cut = self.hub._take(self.hub._cuts, meta["path"])
                if cut is None and self.hub.cut_after_bytes is not None:
                    cut = _Cut(self.hub.cut_after_bytes, None, None, "close")
                if range_header is None:
                    corrupt = self.hub._take(self.hub._corrupts, meta["path"])
            self._start(status, headers)
            if self.command == "HEAD":
                return
            flip = None
            if corrupt is not None and length:
                at = max(0, length // 2 - corrupt.nbytes // 2)
                flip = (at, min(length, at + corrupt.nbytes))
            self._stream(f, start, length, cut, flip)
        finally:
            f.close()

    def _stream(self, f, start: int, length: int, cut: _Cut | None, flip: tuple[int, int] | None = None):
        f.seek(start)
        limit = length if cut is None else min(length, cut.after)
        t0 = time.monotonic()
        while self._sent < limit:
            rate = self.hub.throttle_bytes_per_s
            chunk_size = 256 * 1024 if not rate else int(min(64 * 1024, max(1, rate // 20)))
            chunk = f.read(min(chunk_size, limit - self._sent))
            if not chunk:
                break
            if flip is not None and flip[0] < self._sent + len(chunk) and self._sent < flip[1]:
                chunk = bytearray(chunk)
                for i in range(max(flip[0], self._sent), min(flip[1], self._sent + len(chunk))):
                    chunk[i - self._sent] ^= 0xFF
                self._corrupted = True
            self.wfile.write(chunk)
            self._sent += len(chunk)
            if rate:
                ahead = self._sent / rate - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(min(ahead, 0.25))
        if cut is not None and self._sent < length:
            self._cut = True
            self.close_connection = True
            if cut.mode == "reset":
                with contextlib.suppress(OSError):
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
            else:
                with contextlib.suppress(OSError):
                    self.connection.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def use_hub(server: HubServer | str, hf_home: str | os.PathLike | None = None) -> Iterator[None]:
    """Point this process's huggingface_hub (and so transformers) at ``server`` until exit; see module docstring.

    ``hf_home``: also redirect the cache (``<hf_home>/hub``), assets and token paths there. Restores everything
    and closes huggingface_hub's shared HTTP client on exit."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    endpoint = server if isinstance(server, str) else server.url
    patch = {
        "ENDPOINT": endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
    }
    env = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": endpoint}
    if hf_home is not None:
        home = str(hf_home)
        patch.update(
            HF_HOME=home,
            HF_HUB_CACHE=os.path.join(home, "hub"),
            HUGGINGFACE_HUB_CACHE=os.path.join(home, "hub"),
            HF_ASSETS_CACHE=os.path.join(home, "assets"),
            HF_TOKEN_PATH=os.path.join(home, "token"),
            HF_STORED_TOKENS_PATH=os.path.join(home, "stored_tokens"),
        )
        env["HF_HOME"] = home
    saved = {k: getattr(constants, k) for k in patch if hasattr(constants, k)}
    saved_env = {k: os.environ.get(k) for k in (*env, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    for k, v in patch.items():
        setattr(constants, k, v)
    os.environ.update(env)  # for code (and children) that read the environment at call time
    os.environ.pop("HF_TOKEN", None)
    os.environ.pop("HUGGING_FACE_HUB_TOKEN", None)
    _http.close_session()
    try:
        yield
    finally:
        _http.close_session()
        for k in patch:
            if k in saved:
                setattr(constants, k, saved[k])
            else:
                delattr(constants, k)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
