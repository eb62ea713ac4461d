"""Object storage: a checkpoint's planned bytes read with range requests from ``s3://bucket/prefix`` or any fsspec
store whose filesystem reads ranges, straight into memory.

``ObjectStore`` is one fsspec filesystem opened for one URL (``storage_options`` go to the filesystem, as pandas,
datasets and DCP pass them; credentials and endpoints come from the provider chain, ``AWS_ENDPOINT_URL`` included).
It lists the objects under the prefix with their ETag (and VersionId where the bucket is versioned), and reads ranges
of them. On S3 every range read carries the ETag planned with (``If-Match``, or the VersionId), so an object replaced
while a load runs fails the read (412) instead of mixing two checkpoints: ``RemoteFileChangedError``, naming it.
``ObjectStoreRanges`` is the byte source over it; under a process group ``exchange.CooperativeRanges`` fetches its
spans through one (every byte fetched once per job).

Requests are what object stores serve best: the stream's chunks (a few MiB), many in flight. A reader that
converts (fp32 stored, bf16 loaded) takes each body as it arrives (``read_streamed``), so it holds 256 KiB of it
rather than a chunk: 16 readers staged 16 chunks (0.06x of a 1 GB model) before. Retries are the
client's (botocore's, for 503 SlowDown and 5xx) then a few of ours with backoff for dropped or stalled connections;
then ``ObjectStoreError`` naming the object and the last answer. fsspec and s3fs are imported when a store is opened,
never by ``import lowmem_hf`` (``pip install lowmem_hf[s3]``).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Mapping

from ..compat import fsspec_api
from ..errors import CheckpointNotFoundError, ObjectStoreCredentialsError, ObjectStoreError, RemoteFileChangedError
from ..types import RemoteFile
from . import STREAM_PIECE_BYTES, ByteSource, ReadPolicy

__all__ = ["ObjectStore", "ObjectStoreRanges", "DOWNLOAD_CHUNK_BYTES"]

_MAX_ATTEMPTS = 2
"""Attempts of ours, each after the client's own retries (botocore's and s3fs's: 503 SlowDown, 5xx, resets)."""
DOWNLOAD_CHUNK_BYTES = 16 * 1024 * 1024
"""One request of a whole-object download (``.bin`` shards, DCP files, small files)."""
_DEFAULT_OPTIONS = {"s3": {"config_kwargs": {"max_pool_connections": 32}}}
"""What a store gets unless ``storage_options`` says otherwise: enough pooled connections for the reader threads."""
_CREDENTIAL_ERRORS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")


def _backoff(attempt: int) -> None:
    time.sleep(min(0.1 * 2**attempt, 2.0))


def _is_transport_error(e: BaseException) -> bool:
    """What a store or the way to it may raise and later not: an ``OSError`` (s3fs's translation of an S3 error,
    a reset), a timeout, or an error of the HTTP client stack."""
    module = type(e).__module__.split(".")[0]
    return isinstance(e, (OSError, TimeoutError)) or module in ("botocore", "aiobotocore", "aiohttp", "urllib3", "fsspec", "s3fs")


def _answer(e: BaseException) -> str:
    """The store's last answer as the message shows it: ``503 SlowDown: <message>`` where s3fs kept botocore's
    error as the cause (its own ``OSError`` drops the status and the code), else the exception."""
    response = getattr(e.__cause__, "response", None) or getattr(e, "response", None)
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        text = f"{status} {response['Error'].get('Code', '?')}: {response['Error'].get('Message', '')}"
    else:
        text = f"{type(e).__name__}: {e}"
    return " ".join(text.split())


def _with_defaults(protocol: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` over ``_DEFAULT_OPTIONS`` of ``protocol``, nested dicts (``config_kwargs``) merged key by key."""
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in _DEFAULT_OPTIONS.get(protocol, {}).items()}
    for key, value in options.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key].update(value)
        else:
            merged[key] = value
    return merged


class ObjectStore:
    """One fsspec filesystem and the prefix a load reads under (see the module doc). Thread-safe as fsspec is."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        try:
            import fsspec
        except ImportError as e:
            raise ImportError(f"Loading {url} needs fsspec and s3fs: pip install 'lowmem_hf[s3]'.") from e
        self.url = url.rstrip("/")
        self.protocol = url.split("://", 1)[0]
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **_with_defaults(self.protocol, storage_options or {}))
        except ImportError as e:  # fsspec's own message names the package (s3fs, gcsfs, adlfs...)
            raise ImportError(f"Loading {url}: {e} (for s3://, pip install 'lowmem_hf[s3]').") from e
        self.root = root.rstrip("/")
        self.bucket = self.root.split("/", 1)[0]
        self._conditional = fsspec_api.is_s3(self.fs)
        self.streams = self._conditional
        """Whether ``read_streamed`` works here (S3)."""

    def url_of(self, name: str) -> str:
        """The URL of ``name``, a path under the prefix."""
        return f"{self.url}/{name}"

    def list(self) -> dict[str, RemoteFile]:
        """Every object under the prefix, by its path under it, pinned to its size, ETag and VersionId.

        Raises:
            CheckpointNotFoundError: no object under the prefix (or no such bucket).
            ObjectStoreCredentialsError, ObjectStoreError: as for reads.
        """
        # fsspec caches listings per filesystem instance: a second load in this process must see objects replaced since
        self.fs.invalidate_cache(self.root)
        found = self._call(lambda: self.fs.find(self.root, detail=True), what=f"listing {self.url}/", url=self.url)
        objects = {}
        for path, info in sorted(found.items()):
            path = path.rstrip("/")
            if info.get("type") == "directory" or not path.startswith(self.root + "/"):
                continue  # fsspec may list "prefix2/..." for a prefix "prefix": not under it
            name = path[len(self.root) + 1 :]
            etag = info.get("ETag") or info.get("etag")
            objects[name] = RemoteFile(
                filename=name, url=self.url_of(name), size=int(info["size"]), etag=etag, version=info.get("VersionId"),
            )
        if not objects:
            raise CheckpointNotFoundError(
                f"{self.url}: no object under this prefix. Check the bucket and prefix (a checkpoint saved with "
                "save_pretrained and copied there, e.g. with `aws s3 sync`)."
            )
        return objects

    def read_into(self, remote: RemoteFile, view: memoryview, start: int) -> None:
        """Fill ``view`` with the bytes of ``remote`` from ``start``, conditional on the ETag (or version) it was planned
        with; S3 bodies land in ``view`` as they arrive.

        Raises:
            RemoteFileChangedError: the object was replaced or removed since planning.
            ObjectStoreCredentialsError: no credentials, or refused.
            ObjectStoreError: the store kept failing (names the object and the last answer).
        """
        path, stop = f"{self.root}/{remote.filename}", start + len(view)

        def read() -> int:
            if self._conditional:
                return fsspec_api.s3_get_range_into(self.fs, path, start, view, etag=remote.etag, version=remote.version)
            data = self.fs.cat_file(path, start=start, end=stop)
            view[: len(data)] = data[: len(view)]
            return len(data)

        got = self._call(read, what=f"bytes {start}-{stop - 1}", url=remote.url, planned=remote)
        _check_length(remote, start, stop, got)

    def read_streamed(self, remote: RemoteFile, start: int, nbytes: int, consume) -> None:
        """``read_into`` without the buffer: bytes ``[start, start + nbytes)`` of ``remote`` handed to ``consume(piece,
        at)`` as they arrive, in order, in pieces of ``STREAM_PIECE_BYTES`` (the last one shorter). A retried request
        hands them over again from ``at`` 0. S3 only (``streams``: s3fs's body can be read as it arrives; other
        fsspec stores return a range whole). Raises as ``read_into`` does."""
        path, stop = f"{self.root}/{remote.filename}", start + nbytes

        def read() -> int:
            return fsspec_api.s3_get_range_streamed(
                self.fs, path, start, nbytes, consume, piece_bytes=STREAM_PIECE_BYTES, etag=remote.etag, version=remote.version,
            )

        got = self._call(read, what=f"bytes {start}-{stop - 1}", url=remote.url, planned=remote)
        _check_length(remote, start, stop, got)

    def read_range(self, remote: RemoteFile, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of ``remote`` (``read_into`` a buffer of their own)."""
        buffer = bytearray(stop - start)
        self.read_into(remote, memoryview(buffer), start)
        return bytes(buffer)

    def download(self, remote: RemoteFile, path: str) -> str:
        """``remote`` into the local file ``path`` (written aside, then renamed), by conditional range reads."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.{threading.get_ident()}.incomplete"
        try:
            buffer = memoryview(bytearray(min(remote.size, DOWNLOAD_CHUNK_BYTES)))
            with open(partial, "wb") as f:
                for start in range(0, remote.size, DOWNLOAD_CHUNK_BYTES):
                    piece = buffer[: min(remote.size - start, DOWNLOAD_CHUNK_BYTES)]
                    self.read_into(remote, piece, start)
                    f.write(piece)
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
        return path

    def _call(self, call, *, what: str, url: str, planned: RemoteFile | None = None):
        """``call()``, retried on what may pass (5xx, SlowDown, dropped or stalled connections); the rest named."""
        last: BaseException | None = None
        for attempt in range(_MAX_ATTEMPTS):
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - each kind is named below, the rest retried then named
                permanent = _permanent(e, bucket=self.bucket, what=what, url=url, planned=planned)
                if permanent is not None:
                    raise permanent from e
                if not _is_transport_error(e):
                    raise  # a bug or a bad storage_options value: as it is, not as the store's fault
                last = e
            if attempt + 1 < _MAX_ATTEMPTS:
                _backoff(attempt)
        answer = _answer(last)
        fix = "Check the endpoint and the network to it (storage_options, AWS_ENDPOINT_URL), and load again."
        raise ObjectStoreError(
            f"{url}: {what} failed {_MAX_ATTEMPTS} times (each after the client's own retries); the last answer was "
            f"{answer}. {fix}", file=url, found=answer, fix=fix,
        ) from last


def _check_length(remote: RemoteFile, start: int, stop: int, got: int) -> None:
    """A body shorter than the range asked for: the object changed (a conditional read of it would have failed)."""
    if got != stop - start:
        raise RemoteFileChangedError(
            f"{remote.url}: asked for bytes {start}-{stop - 1} of the {remote.size} planned (etag {remote.etag}), "
            f"got {got}. The object changed; load again to re-plan.", file=remote.url,
        )


def _permanent(e: BaseException, *, bucket: str, what: str, url: str, planned: RemoteFile | None) -> Exception | None:
    """The named error for a failure that a retry cannot fix; None for one worth retrying."""
    if type(e).__name__ in _CREDENTIAL_ERRORS or isinstance(e, PermissionError):
        how = "found no credentials" if type(e).__name__ in _CREDENTIAL_ERRORS else "refused the credentials (403)"
        fix = (
            "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass storage_options="
            "{'key': ..., 'secret': ...} (or {'anon': True} for a public bucket); AWS_ENDPOINT_URL or "
            "storage_options={'endpoint_url': ...} for a store other than AWS."
        )
        return ObjectStoreCredentialsError(
            f"{url}: the store {how} for bucket {bucket!r} ({what}). {fix}", file=url, key=bucket, fix=fix,
        )
    if isinstance(e, FileNotFoundError):
        if planned is not None:
            return RemoteFileChangedError(
                f"{url}: the load was planned with this object (etag {planned.etag}) but the store now answers "
                "404 Not Found for it. It was removed; load again to re-plan.", file=url,
            )
        return CheckpointNotFoundError(f"{url}: not found (404) in bucket {bucket!r} ({what}). Check the URL.", file=url)
    if planned is not None and isinstance(e, OSError) and e.errno == errno.EINVAL and "condition" in str(e):
        return RemoteFileChangedError(
            f"{url}: the load was planned with etag {planned.etag}"
            + (f" (version {planned.version})" if planned.version else "")
            + " but the object was replaced since (412 Precondition Failed). Load again to re-plan.", file=url,
        )
    return None


class ObjectStoreRanges(ByteSource):
    """Byte source over an ``ObjectStore`` (see the module doc): each ``read`` is one conditional range request."""

    # Requests wait on the network: many in flight hide the per-request latency; a dim-1 slice is read as bands of
    # rows, one request each. In-flight memory stays workers x chunk_bytes.
    policy = ReadPolicy(workers=16, band_reads=True)

    def __init__(self, remote: Mapping[str, RemoteFile], store: ObjectStore):
        self._remote, self._store = remote, store
        self._count = threading.Lock()
        self.requests = 0
        """Range requests that delivered their bytes."""
        self.bytes_fetched = 0
        """Body bytes received from the store."""

    def read(self, file: str, view: memoryview, offset: int) -> None:
        self._store.read_into(self._remote[file], view, offset)
        self._counted(len(view))

    def streams(self, file: str, offset: int, nbytes: int) -> bool:
        return self._store.streams

    def read_streamed(self, file: str, offset: int, nbytes: int, consume) -> None:
        self._store.read_streamed(self._remote[file], offset, nbytes, consume)
        self._counted(nbytes)

    def _counted(self, nbytes: int) -> None:
        with self._count:
            self.requests += 1
            self.bytes_fetched += nbytes
