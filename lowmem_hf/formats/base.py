"""What every format's reader shares: the contract with the stream, byte views (its counters: ``stats.py``; staging: ``staging.py``)."""

from __future__ import annotations

import functools
import io
from typing import Callable

import torch

from ..runs import chunk_runs, element_extent, element_runs
from ..sources import ByteSource
from ..types import ShardSpec, TensorInfo
from .staging import Staging
from .stats import StreamStats

__all__ = ["Reader", "RangeReader", "StreamStats", "Staging", "SourceFile", "byte_view"]


class Reader:
    """The contract between a format's reader and the stream (``stream.stream`` drives it).

    ``jobs`` returns independent reads that together fill a destination (already of the decided dtype and
    device) with the stored tensor or this rank's slice of it, converting on the fly; the stream calls ``fence``
    once their destinations are allocated, runs them on its threads, then calls ``done``, and ``publish`` before
    it hands the tensors on. ``close`` comes last, once every job has finished. Nothing of a file stays
    mapped or buffered afterwards (except ``mmap=True`` views, which are the parameters).
    """

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        """Reads that together fill ``dst`` with ``info``'s tensor (or its ``shard`` slice); safe to run at once."""
        raise NotImplementedError

    def hint(self, info: TensorInfo, shard: ShardSpec | None) -> None:
        """Files not in the page cache: announce the bytes these jobs will need, as they enter the read-ahead window."""

    def view(self, info: TensorInfo, dtype: torch.dtype, shape: tuple[int, ...], shard: ShardSpec | None, device) -> torch.Tensor | None:
        """``mmap=True``: the tensor as a view of its file, read by no job; None: read it."""
        return None

    def done(self, info: TensorInfo, nbytes: int) -> None:
        """Account one finished tensor (``nbytes`` read)."""
        raise NotImplementedError

    _staging: Staging | None = None
    """The reader's staging buffers and the copies out of them, where it stages (the three methods below)."""

    def fence(self, device: torch.device) -> None:
        """The destinations on ``device`` of the jobs about to run were just allocated on the calling thread's
        current stream."""
        if self._staging is not None:
            self._staging.fence(device)

    def publish(self) -> None:
        """Every finished job's copies are visible to the calling thread's current stream (a device destination
        may be written on other streams)."""
        if self._staging is not None:
            self._staging.publish()

    def close(self) -> None:
        """Release what the reader holds (every job has finished): a staging reader waits for its copies."""
        if self._staging is not None:
            self._staging.close()


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (for ``preadv``)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class RangeReader(Reader):
    """Reads tensors stored as raw row-major (little-endian) bytes at ``TensorInfo.offset`` of their file, or slices
    of them, from any byte source (local files, HTTP ranges, the exchange): safetensors tensors, and the tensors of
    ``torch.save`` zip archives (``torch_pickle``).

    Same dtype on a CPU destination: straight into the destination's memory (``source.populate`` first: a local
    source faults its fresh pages in before the copy), no staging at all. Otherwise: through
    a reused staging buffer of ``chunk_bytes`` per worker thread (pinned when the destination is a CUDA device, two
    while copies overlap reads: ``Staging``), converted by ``copy_`` chunk by chunk, each chunk's host destination populated first as well. Every read is
    ``read``/``read_runs`` of the source (``preadv`` for local files): a file that ends early raises the source's
    named error, where a mapping of it would kill the process with SIGBUS. Onto the CPU from a source that streams
    (``ByteSource.streams``: an object store's bodies, a cooperative fetch's held bytes), no staging either: each
    piece is converted as the source hands it over (``read_streamed``).
    """

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, stats: StreamStats, source: ByteSource):
        self._remaining = dict(plan_counts)
        self._source = source
        self._staging = Staging(stats)
        self._chunk_bytes = chunk_bytes
        self._stats = stats

    def hint(self, info: TensorInfo, shard: ShardSpec | None) -> None:
        """Announce the bytes this tensor (slice) will need, so a cold file is read ahead of the workers."""
        first, last, needed = element_extent(info.shape, shard)
        if not needed:
            return
        itemsize = info.dtype.itemsize
        if needed * 2 >= last - first:  # dense enough that reading the gaps too costs less than it saves
            self._source.will_need(info.file, info.offset + first * itemsize, info.offset + last * itemsize)

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        """Independent chunk reads that together fill ``dst`` with the tensor (or its ``shard`` slice).

        Only the slice's bytes are read: a dim-0 slice is one byte range, a slice of another dim one range
        per leading index. Safe to run on several threads at once.
        """
        self._stats.opened(info.file)
        source, itemsize = self._source, info.dtype.itemsize
        runs = element_runs(info.shape, shard)
        if source.policy.band_reads and len(runs) > 1 and max(n for _, n in runs) * itemsize <= self._chunk_bytes:
            return self._band_jobs(info, dst, runs)
        if source.policy.gap_bytes and len(runs) > 1:
            jobs = self._strided_jobs(info, dst, runs)
            if jobs is not None:
                return jobs
        chunks = chunk_runs(runs, itemsize, self._chunk_bytes)
        if dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous():
            view = byte_view(dst)

            def direct(chunk: list[tuple[int, int, int]]) -> None:
                parts = [(view[at * itemsize : (at + n) * itemsize], info.offset + src * itemsize) for src, at, n in chunk]
                source.populate([part for part, _ in parts])
                source.read_runs(info.file, parts)

            return [functools.partial(direct, c) for c in chunks]

        flat = dst.view(-1)
        host = dst.device.type == "cpu"

        def staged(chunk: list[tuple[int, int, int]]) -> None:
            if host and source.streams(info.file, info.offset + chunk[0][0] * itemsize, (chunk[-1][0] + chunk[-1][2] - chunk[0][0]) * itemsize):
                return _streamed(source, info, flat, chunk)  # converted as the bytes arrive or where they lie: no chunk staged
            total = sum(n for _, _, n in chunk)
            buf = self._staging.get(total * itemsize, device=dst.device)
            bytes_view, pos, parts = byte_view(buf), 0, []
            for src, _, n in chunk:
                parts.append((bytes_view[pos : pos + n * itemsize], info.offset + src * itemsize))
                pos += n * itemsize
            source.read_runs(info.file, parts)
            first = chunk[0][1]  # the runs of a chunk are consecutive in the destination
            out = flat[first : first + total]
            if host:
                source.populate([byte_view(out)])  # the destination's fresh pages, in one call rather than in the copy
            self._staging.copy(out, buf.view(info.dtype))

        return [functools.partial(staged, c) for c in chunks]

    def _strided_jobs(self, info: TensorInfo, dst: torch.Tensor, runs: list[tuple[int, int]]) -> list[Callable[[], None]] | None:
        """A source that reads through gaps (local files in the page cache), a slice that is equal runs at a fixed stride (a dim-1 slice: one run
        per row): bands of whole rows, each one ``preadv`` into staging and one strided ``copy_`` (converting)
        into ``dst``. None where that does not apply (irregular runs, gaps over the policy's ``gap_bytes``, a row over
        ``chunk_bytes``). Per-run reads cost a syscall and some Python per row, and with two ranks on two cores
        that Python holds the GIL against the thread assigning; this path has none per row."""
        first, n = runs[0]
        stride = runs[1][0] - first
        itemsize = info.dtype.itemsize
        if (stride - n) * itemsize > self._source.policy.gap_bytes or stride * itemsize > self._chunk_bytes or not dst.is_contiguous():
            return None
        if any(src != first + i * stride or m != n for i, (src, m) in enumerate(runs)):
            return None
        rows, per_band = len(runs), max(1, self._chunk_bytes // (stride * itemsize))
        flat, source = dst.view(-1), self._source

        def band(r0: int, r1: int) -> None:
            span = (r1 - r0 - 1) * stride + n  # through the last row's run, not its gap
            buf = self._staging.get(span * itemsize, device=dst.device)
            source.read(info.file, byte_view(buf), info.offset + (first + r0 * stride) * itemsize)
            stored = buf.view(info.dtype).as_strided((r1 - r0, n), (stride, 1))
            out = flat[r0 * n : r1 * n]
            if dst.device.type == "cpu":
                source.populate([byte_view(out)])
            self._staging.copy(out.view(r1 - r0, n), stored)
            source.count_gap((r1 - r0 - 1) * (stride - n) * itemsize)

        return [functools.partial(band, r, min(r + per_band, rows)) for r in range(0, rows, per_band)]

    def _band_jobs(self, info: TensorInfo, dst: torch.Tensor, runs: list[tuple[int, int]]) -> list[Callable[[], None]]:
        """Sources whose policy has ``band_reads`` (HTTP): a slice of several runs (a dim-1 slice: one per row) is fetched as bands
        of whole rows, one request per band of at most ``chunk_bytes`` (or one run), and only its runs are kept.
        Per-row requests would cost one round trip per row; the bytes between the runs are the price, counted in
        ``band_extra_bytes``."""
        itemsize, flat, limit = info.dtype.itemsize, dst.view(-1), max(1, self._chunk_bytes // info.dtype.itemsize)
        bands: list[list[tuple[int, int, int]]] = []
        at = 0
        for src, n in runs:
            if bands and src + n - bands[-1][0][0] <= limit:
                bands[-1].append((src, at, n))
            else:
                bands.append([(src, at, n)])
            at += n

        def band(parts: list[tuple[int, int, int]]) -> None:
            first, end = parts[0][0], parts[-1][0] + parts[-1][2]
            buf = self._staging.get((end - first) * itemsize, device=dst.device)
            self._source.read(info.file, byte_view(buf), info.offset + first * itemsize)
            stored = buf.view(info.dtype)
            for src, at, n in parts:
                self._staging.copy(flat[at : at + n], stored[src - first : src - first + n])

        self._stats.band_extra_bytes += sum((b[-1][0] + b[-1][2] - b[0][0]) * itemsize for b in bands) - dst.numel() * itemsize
        return [functools.partial(band, b) for b in bands]

    def done(self, info: TensorInfo, nbytes: int) -> None:
        """Account one finished tensor (``nbytes`` read); after the file's last one, ``finished`` and release it."""
        self._stats.read(nbytes)
        self._remaining[info.file] -= 1
        if self._remaining[info.file] == 0:
            try:
                self.finished(info.file)
            finally:
                self._source.release(info.file)

    def finished(self, file: str) -> None:
        """Every planned read of ``file`` is done; its source still holds it (a format may check it here)."""


def _streamed(source: ByteSource, info: TensorInfo, flat: torch.Tensor, chunk: list[tuple[int, int, int]]) -> None:
    """One chunk's runs ``(first element, place in flat, elements)`` of ``info`` into ``flat``, through
    ``read_runs_streamed`` (``RangeReader.jobs``, where the source streams)."""
    itemsize = info.dtype.itemsize
    first, last = chunk[0][1], chunk[-1][1] + chunk[-1][2]  # the runs of a chunk are consecutive in the destination
    source.populate([byte_view(flat[first:last])])
    runs = [(info.offset + src * itemsize, n * itemsize) for src, _, n in chunk]
    source.read_runs_streamed(info.file, runs, _Converting(flat[first:last], info.dtype))


class _Converting:
    """``consume`` of a streamed read (``ByteSource.read_streamed``) into ``out``: each piece's whole elements are
    converted as they come; an element split between two pieces waits for its rest."""

    def __init__(self, out: torch.Tensor, dtype: torch.dtype):
        self._out, self._dtype, self._size = out, dtype, dtype.itemsize
        self._carry, self._next = b"", 0

    def __call__(self, piece: memoryview, at: int) -> None:
        if at != self._next:  # a retried request hands its bytes over again, from an element's start
            self._carry = b""
        self._next = at + len(piece)
        if self._carry:
            at -= len(self._carry)
            piece = memoryview(bytearray(self._carry) + piece)
        k = len(piece) // self._size
        if k:
            self._out[at // self._size : at // self._size + k].copy_(torch.frombuffer(piece, dtype=self._dtype, count=k))
        self._carry = bytes(piece[k * self._size :])


class SourceFile(io.RawIOBase):
    """A read-only, seekable file over the window ``[offset, offset + length)`` of ``file`` in a byte source: what
    ``zipfile`` and the unpicklers need to look inside an archive through the same descriptor the tensor reads use
    (DCP's own view cannot ``read()`` to the end, which ``zipfile`` needs). ``counter`` is told every byte read."""

    def __init__(self, source: ByteSource, file: str, offset: int, length: int, counter: Callable[[int], None] | None = None):
        super().__init__()
        self._source, self._file = source, file
        self._offset, self._length, self._pos, self._count = offset, length, 0, counter

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._length + pos
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        self._source.read(self._file, view[:n], self._offset + self._pos)
        self._pos += n
        if self._count is not None:
            self._count(n)
        return n
