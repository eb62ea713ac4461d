"""HTTP ranges: a Hub file's planned bytes fetched with Range requests through huggingface_hub's session, into the
tensors or, where the dtype changes, converted as the body arrives (``read_streamed``).

Nothing is written to disk. A dropped connection resumes from the last byte received; a remote file whose
size or etag differs from the plan raises ``RemoteFileChangedError`` instead of yielding a corrupted tensor.
Planning reads the safetensors headers through the same reads (``hub.resolve_hub``), so they resume and check alike.
Files already in the HF cache are read there (``LocalFiles``) and fetched not at all.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Mapping, TypeVar

from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from ..errors import CorruptCheckpointError, HubConnectionError, RemoteFileChangedError
from ..types import RemoteFile
from . import STREAM_PIECE_BYTES, ByteSource, ReadPolicy
from .local import LocalFiles

# huggingface_hub 2.x ships httpx under its own module name; its transport errors are what a dropped
# connection raises mid-body, and they are the ones worth a resume.
try:
    import httpx2 as _httpx
except ImportError:  # pragma: no cover - older huggingface_hub
    import httpx as _httpx

__all__ = ["HttpRanges", "retry_hub_call"]

TRANSPORT_ERRORS = (_httpx.TransportError, _httpx.StreamError)
"""What a dropped or cut connection raises, mid-body or before it."""

_MAX_ATTEMPTS = 5


T = TypeVar("T")


def is_retryable_status(status: int) -> bool:
    """5xx, 408 and 429: the server may answer the same request later, as huggingface_hub's own downloads retry."""
    return status >= 500 or status in (408, 429)


def _backoff(attempt: int) -> None:
    time.sleep(min(0.05 * 2**attempt, 1.0))


def _why_retry(e: BaseException) -> str | None:
    """What a failed huggingface_hub request met, where the same request may succeed later; None where it would not."""
    if isinstance(e, TRANSPORT_ERRORS):
        return f"the connection kept dropping ({type(e).__name__}: {e})"
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else None
        return f"the server answered {status}" if status is not None and is_retryable_status(status) else None
    if isinstance(e, LocalEntryNotFoundError):
        # hf_hub_download's answer when the HEAD of a file it has not cached failed: the HEAD's error is the cause
        # (offline mode is a cause too, and never retryable)
        return _why_retry(e.__cause__) if e.__cause__ is not None else None
    if type(e) is OSError and e.errno is None:  # an OSError from the disk carries an errno
        return f"the body stayed short ({e})".replace("\n", " ")
    return None


def retry_hub_call(call: Callable[[], T], *, what: str, file: str) -> T:
    """``call()`` (a huggingface_hub request: a HEAD, a download), retried as the range reads are when the connection
    drops or the server answers a retryable status, ``_MAX_ATTEMPTS`` times in all; then ``HubConnectionError``
    naming ``what`` and what the last attempt met, with ``file`` (the repo path) as its field. Other errors pass
    through at once.

    Written here because huggingface_hub retries neither a HEAD answered 5xx (``hf_hub_download`` turns it into
    ``LocalEntryNotFoundError`` for a file it has not cached) nor a download whose body stayed short (its
    "Consistency check failed" ``OSError``, which carries no errno).
    """
    for attempt in range(_MAX_ATTEMPTS):
        try:
            return call()
        except Exception as e:
            why, last = _why_retry(e), e
            if why is None:
                raise
        if attempt + 1 < _MAX_ATTEMPTS:
            _backoff(attempt)
    fix = "Check the network (or proxy) to the Hub and load again."
    raise HubConnectionError(f"{what} failed {_MAX_ATTEMPTS} times; the last time {why}. {fix}", file=file, found=why, fix=fix) from last


class HttpRanges(ByteSource):
    """Byte source over HTTP Range requests (see module doc). Thread-safe: huggingface_hub's client is."""

    # Requests wait on the network, not the CPU: more of them in flight hides per-request latency; a dim-1 slice
    # is fetched as bands of rows, one request each, not one per row. A band is staged (at most workers x
    # chunk_bytes); any other range goes straight into its tensor, or where the dtype changes is converted as it
    # arrives (``read_streamed``).
    policy = ReadPolicy(workers=8, band_reads=True)

    def __init__(self, remote: Mapping[str, RemoteFile], *, token=None, local: Mapping[str, str] | None = None):
        self._remote = remote
        self._count = threading.Lock()
        self.requests = 0
        """HTTP requests made (a resumed request counts again)."""
        self.bytes_fetched = 0
        """Body bytes received from the network."""
        self._headers = build_hf_headers(token=token)
        self._headers["Accept-Encoding"] = "identity"  # sizes and offsets are of the raw bytes
        self._local = None
        if local:
            self._local = LocalFiles(local)  # already in the HF cache: read there, fetch nothing

    def read(self, file: str, view: memoryview, offset: int) -> None:
        if file not in self._remote:
            self._local.read(file, view, offset)
            return

        def into(data: bytes, at: int) -> None:
            view[at : at + len(data)] = data

        self._get(self._remote[file], offset, len(view), into)

    def streams(self, file: str, offset: int, nbytes: int) -> bool:
        """Remote files stream (``read_streamed``); files already in the HF cache are read there."""
        return file in self._remote

    def read_streamed(self, file: str, offset: int, nbytes: int, consume) -> None:
        """The body handed to ``consume(piece, at)`` in pieces of ``STREAM_PIECE_BYTES`` (the last one shorter) as
        it arrives; a dropped connection resumes from the last byte received, so nothing is handed over twice. A
        reader converting the range then holds one piece of it, not the whole range."""
        piece, filled = memoryview(bytearray(min(STREAM_PIECE_BYTES, nbytes))), [0, 0]  # bytes in piece, its at

        def gather(data: bytes, at: int) -> None:
            data = memoryview(data)
            while len(data):
                take = min(len(data), len(piece) - filled[0])
                piece[filled[0] : filled[0] + take] = data[:take]
                filled[0], data = filled[0] + take, data[take:]
                if filled[0] == len(piece):
                    consume(piece, filled[1])
                    filled[:] = [0, filled[1] + len(piece)]

        self._get(self._remote[file], offset, nbytes, gather)
        if filled[0]:
            consume(piece[: filled[0]], filled[1])

    def _get(self, remote: RemoteFile, offset: int, nbytes: int, sink) -> None:
        """Bytes ``[offset, offset + nbytes)`` of ``remote``, each body part handed to ``sink(data, at)`` in order
        (``at``: its place in the range); a dropped connection or a retryable answer resumes from the last byte
        received, ``_MAX_ATTEMPTS`` times in all."""
        end, received = offset + nbytes, 0
        refused = None  # the last retryable status (5xx, 408, 429): retried like a dropped connection
        for attempt in range(_MAX_ATTEMPTS):
            if received == nbytes:
                return
            headers = dict(self._headers, Range=f"bytes={offset + received}-{end - 1}")
            before = received
            try:
                with get_session().stream("GET", remote.url, headers=headers, follow_redirects=True) as response:
                    self._check_satisfiable(remote, response, offset + received, end)
                    refused = response.status_code if is_retryable_status(response.status_code) else None
                    if refused is None:
                        self._check_found(remote, response)
                        hf_raise_for_status(response)
                        self._check(remote, response, offset + received, end)
                        for data in response.iter_bytes():
                            data = data[: nbytes - received]
                            sink(data, received)
                            received += len(data)
            except TRANSPORT_ERRORS:
                refused = None  # resume below from the last byte received
            finally:
                with self._count:
                    self.requests += 1
                    self.bytes_fetched += received - before
            if received < nbytes:
                _backoff(attempt)
        if received < nbytes:
            why = f"the server answered {refused} to the last one" if refused is not None else "the connection keeps dropping"
            raise HubConnectionError(
                f"{remote.filename}: got {received} of {nbytes} bytes at offset {offset} after {_MAX_ATTEMPTS} "
                f"attempts; {why}. Check the network (or proxy) to the Hub and load again."
            )

    @staticmethod
    def _check_found(remote: RemoteFile, response) -> None:
        """404 for a file the load was planned with: it was removed from the commit (a server that rewrote it)."""
        if response.status_code == 404:
            raise RemoteFileChangedError(
                f"{remote.filename}: the load was planned with this file (etag {remote.etag}) but the server now "
                "answers 404 Not Found for it. The file was removed; load again to re-plan."
            )

    @staticmethod
    def _check_satisfiable(remote: RemoteFile, response, start: int, end: int) -> None:
        """416: the bytes the plan reads are past the end of the file the server has now (it was cut or replaced)."""
        if response.status_code == 416:
            total = response.headers.get("Content-Range", "").rpartition("/")[2]
            now = f"the server now has {int(total)} bytes" if total.isdigit() else "the server has fewer"
            raise RemoteFileChangedError(
                f"{remote.filename}: the load was planned for {remote.size} bytes (etag {remote.etag}) and reads bytes "
                f"{start}-{end - 1}, but {now} (416 Range Not Satisfiable). The file changed; load again to re-plan."
            )

    @staticmethod
    def _check(remote: RemoteFile, response, start: int, end: int) -> None:
        if response.status_code != 206:
            raise CorruptCheckpointError(
                f"{remote.filename}: asked for bytes {start}-{end - 1}, the server answered {response.status_code} "
                "instead of 206 Partial Content; the endpoint must support Range requests (use fetch='files')."
            )
        content_range = response.headers.get("Content-Range", "")
        total = content_range.rpartition("/")[2]
        if total.isdigit() and int(total) != remote.size:
            raise RemoteFileChangedError(
                f"{remote.filename}: the load was planned for {remote.size} bytes (etag {remote.etag}) "
                f"but the server now has {int(total)} bytes. The file changed; load again to re-plan."
            )
        # After a redirect (the Hub's CDN) the plain ETag is the CDN's own; X-Linked-Etag is always the file's.
        etag = response.headers.get("X-Linked-Etag") or (None if response.history else response.headers.get("ETag"))
        if etag is not None and remote.etag is not None and etag.strip('"').removeprefix("W/").strip('"') != remote.etag:
            raise RemoteFileChangedError(
                f"{remote.filename}: the load was planned for etag {remote.etag} but the server now sends {etag}. "
                "The file changed; load again to re-plan."
            )

    def release(self, file: str) -> None:
        if self._local is not None and file not in self._remote:
            self._local.release(file)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
