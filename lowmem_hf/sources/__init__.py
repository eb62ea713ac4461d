"""Byte sources: where a format's reader gets the bytes of a checkpoint file, behind one small protocol.

A reader asks for ``(file, offset)`` into views it owns (a destination tensor's memory or a staging buffer);
the source decides how the bytes arrive:

- ``local.LocalFiles``: ``preadv`` from local files (also a file's path and mapping, and page-cache hints);
- ``http.HttpRanges``: HTTP Range requests through huggingface_hub, nothing written to disk;
- ``exchange.CooperativeRanges``: under a process group, every byte fetched once by one rank; each rank receives the parts it reads.
  (``schedule``, ``pieces`` and ``wave_status`` are its parts.)

``file`` is a ``TensorInfo.file``: a local path, or the repo path of a Hub checkpoint's file.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ByteSource", "ReadPolicy", "STREAM_PIECE_BYTES"]

STREAM_PIECE_BYTES = 256 * 1024
"""What a streamed read hands over at a time (``ByteSource.read_streamed``): a reader converting a chunk holds this
much of it, not the whole chunk, whatever the request's size."""


@dataclass(frozen=True)
class ReadPolicy:
    """How the stream and the readers read from one source. Each source decides its own, from what it is told when
    it is made (local files: whether they are in the page cache); the default is what a source with no preference
    gets."""

    workers: int | None = None
    """Reader threads this source wants; None: as many as suit local files (``stream.choose_workers``)."""
    band_reads: bool = False
    """Read a slice of many short runs (a dim-1 slice: one per row) as bands of whole rows, one ``read`` per
    band, dropping the bytes between the runs: for sources where each ``read`` costs a request."""
    gap_bytes: int = 0
    """Largest gap between two runs that one read may read through and drop (0: each run is its own read)."""


class ByteSource:
    """The protocol every byte source keeps. A default here is what a source without that capability does.

    Readers call ``read``/``read_runs`` (from several threads at once), ``populate``, ``will_need`` and ``release``;
    the stream calls ``may_read_ahead``, ``before_submodule`` and ``arrange``, follows ``policy``, and calls
    ``close`` once every read is done; the load report reads the counters.
    """

    policy: ReadPolicy = ReadPolicy()
    """How this source is read (threads, bands, gaps)."""

    # Counters, for the load report.
    requests: int = 0
    """HTTP requests made."""
    bytes_fetched: int = 0
    """Body bytes received from the network."""
    bytes_received: int = 0
    """Bytes received from other ranks."""
    gap_bytes_read: int = 0
    """Bytes read between runs and dropped."""

    def read(self, file: str, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the bytes of ``file`` from ``offset``; raise a ``LowMemError`` naming the file if it cannot."""
        raise NotImplementedError

    def read_runs(self, file: str, parts: list[tuple[memoryview, int]]) -> None:
        """Fill each ``(view, offset)`` of ``parts`` (ascending, non-overlapping offsets) from ``file``."""
        for view, offset in parts:
            self.read(file, view, offset)

    def streams(self, file: str, offset: int, nbytes: int) -> bool:
        """Whether ``read_streamed`` serves bytes ``[offset, offset + nbytes)`` of ``file``."""
        return False

    def read_streamed(self, file: str, offset: int, nbytes: int, consume) -> None:
        """Hand bytes ``[offset, offset + nbytes)`` of ``file`` to ``consume(piece, at)`` as they arrive (``at``: the
        piece's place in the range), in order, in pieces of whole elements of any dtype (multiples of 8 bytes but
        the last); a retried request hands its bytes over again. Only where ``streams`` says so: a reader that
        converts then holds a piece rather than a chunk."""
        raise NotImplementedError(f"{type(self).__name__} does not stream reads")

    def read_runs_streamed(self, file: str, runs: list[tuple[int, int]], consume) -> None:
        """``read_streamed`` of each ``(offset, nbytes)`` of ``runs`` in turn, ``consume(piece, at)`` counting ``at``
        over the runs' concatenation (a chunk of a slice: its runs are consecutive in the destination)."""
        done = 0
        for offset, nbytes in runs:
            self.read_streamed(file, offset, nbytes, lambda piece, at, base=done: consume(piece, base + at))
            done += nbytes

    def populate(self, views: list[memoryview]) -> None:
        """The next reads fill ``views`` for the first time (a fresh parameter's memory): fault them in now where that
        makes this source's reads cheaper."""

    def count_gap(self, nbytes: int) -> None:
        """Count ``nbytes`` a reader read between runs and dropped (sources whose ``policy.gap_bytes`` is not 0 only)."""
        raise NotImplementedError(f"{type(self).__name__} reads no gaps (its policy.gap_bytes is 0)")

    def will_need(self, file: str, start: int, stop: int) -> None:
        """A hint: ``[start, stop)`` of ``file`` will be read soon (files not in the page cache)."""

    def before_submodule(self, name: str) -> None:
        """The stream is about to make the reads of submodule ``name``."""

    def may_read_ahead(self, name: str) -> bool:
        """Whether the reads of submodule ``name`` may start while earlier submodules' reads are still in flight
        (within the stream's read-ahead budget); False: the stream first waits for every earlier read."""
        return True

    def arrange(self, name: str, jobs: list) -> list:
        """The reads of submodule ``name`` as the stream should run them (in this order, on its threads): ``jobs``
        as they are, or wrapped where the source must know their order."""
        return jobs

    def release(self, file: str) -> None:
        """Every planned read of ``file`` is done."""

    def close(self) -> None:
        """The load is over (or failed): release everything."""
