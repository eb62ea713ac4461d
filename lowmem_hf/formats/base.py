"""What every format's reader shares: the contract with the stream, its counters, staging buffers, byte views."""

from __future__ import annotations

import functools
import io
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import settings
from ..runs import chunk_runs, element_extent, element_runs
from ..sources import ByteSource
from ..types import ShardSpec, TensorInfo

__all__ = ["Reader", "RangeReader", "StreamStats", "Staging", "CopyRing", "CudaLane", "SourceFile", "byte_view"]


@dataclass
class StreamStats:
    """Counters the stream keeps while it runs (mutable on purpose: it is filled during the stream)."""

    bytes_read: int = 0
    files_read: list[str] = field(default_factory=list)
    staging_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    on_read: Callable[[int], None] | None = None
    """Called with the byte count of each finished tensor (the progress bar)."""
    mapped_bytes: int = 0
    """Bytes of tensors left as copy-on-write views of checkpoint files (``mmap=True``)."""
    band_extra_bytes: int = 0
    """HTTP ranges: bytes fetched beyond the slices because dim-1 slices were fetched as whole row bands."""
    header_bytes: int = 0
    """Format metadata read while streaming (a ``.distcp`` item's archive directory and pickle), not tensor data."""
    device_staging_bytes: int = 0
    """Device memory held for staged chunks converted on the device (``CopyRing``), summed over reader threads."""

    def read(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.on_read is not None:
            self.on_read(nbytes)

    def opened(self, path: str) -> None:
        if path not in self.files_read:
            self.files_read.append(path)

    def staged(self, nbytes: int) -> None:
        self.staging_bytes = max(self.staging_bytes, nbytes)

    def device_staged(self, grown: int) -> None:
        self.device_staging_bytes += grown


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

    def fence(self, device: torch.device) -> None:
        """The destinations on ``device`` of the jobs about to run were just allocated on the calling thread's
        current stream."""

    def publish(self) -> None:
        """Every finished job's copies are visible to the calling thread's current stream (a device destination
        may be written on other streams)."""

    def close(self) -> None:
        """Release what the reader holds (every job has finished)."""


class Staging:
    """Host buffers for chunks that cannot land in place (dtype change, or a device destination), and the copies out
    of them: host staging is ``workers x chunk_bytes`` at most, whatever the model size.

    A CPU destination, or a CUDA one with both switches off (``settings.gpu_overlap``, ``gpu_convert_on_device``):
    one reused buffer per worker thread (pinned for CUDA) and a plain ``copy_``, which blocks. A CUDA destination
    otherwise goes through a ``CopyRing``: two buffers per thread and copies that do not block the next read.
    """

    def __init__(self, stats: StreamStats, *, overlap: bool | None = None, convert_on_device: bool | None = None):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._total = 0
        self._stats = stats
        self._overlap = overlap if overlap is not None else settings.gpu_overlap() is not False
        self._convert = convert_on_device if convert_on_device is not None else settings.gpu_convert_on_device() is not False
        self._ring: CopyRing | None = None

    def get(self, nbytes: int, *, device: torch.device) -> torch.Tensor:
        """A host buffer of ``nbytes`` for the next chunk bound for ``device``, free to fill."""
        ring = self._ring_for(device)
        if ring is not None:
            return ring.get(nbytes)
        pinned = device.type == "cuda"
        buffers = self._local.__dict__.setdefault("buffers", {})
        buf = buffers.get(pinned)
        if buf is None or buf.numel() < nbytes:
            grown = max(nbytes, 1) - (buf.numel() if buf is not None else 0)
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)
            buffers[pinned] = buf
            with self._lock:
                self._total += grown
                self._stats.staged(self._total)
        return buf[:nbytes]

    def copy(self, out: torch.Tensor, stored: torch.Tensor) -> None:
        """``out.copy_(stored)``, ``stored`` a view of the buffer this thread's last ``get`` returned."""
        if self._ring is not None:  # a load has one device: every staged chunk went through the ring
            self._ring.copy(out, stored)
        else:
            out.copy_(stored)

    def fence(self, device: torch.device) -> None:
        """Destinations on ``device`` were just allocated on the calling thread's current stream: copies into them
        come after its work."""
        ring = self._ring_for(device)
        if ring is not None:
            ring.fence()

    def publish(self) -> None:
        """Every copy issued so far is visible to the calling thread's current stream."""
        if self._ring is not None:
            self._ring.publish()

    def close(self) -> None:
        """Wait for every copy (the model is handed back complete, whichever stream reads it)."""
        if self._ring is not None:
            self._ring.synchronize()

    def _ring_for(self, device: torch.device) -> CopyRing | None:
        if device.type != "cuda" or not (self._overlap or self._convert):
            return None
        with self._lock:
            if self._ring is None:
                self._ring = CopyRing(
                    self._stats, device=device, lane=CudaLane if self._overlap else None, convert_on_device=self._convert,
                )
        return self._ring


class CudaLane:
    """One reader thread's side CUDA stream: copies submitted to it run in order, without the thread waiting.

    Streams from torch's pool are created non-blocking: nothing orders them against the current stream but the
    waits below (``after`` before writing into memory allocated on it, ``publish`` before it reads the results).
    The destinations need no ``record_stream`` on the lane: their memory is freed only after ``publish`` (later work
    of the current stream, which may reuse the block, waits for the lane) or after ``synchronize`` (the stream's end,
    errors included).
    """

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    @staticmethod
    def fence(device: torch.device) -> torch.cuda.Event:
        """A mark of the calling thread's current stream: its work so far."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def after(self, mark: torch.cuda.Event) -> None:
        self.stream.wait_event(mark)

    def submit(self, copy: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):  # kernels and the caching allocator's blocks of ``copy`` belong to it
            copy()

    def mark(self) -> torch.cuda.Event:
        """A mark whose ``synchronize()`` returns once everything submitted so far has run."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def publish(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()


class CopyRing:
    """The copies of staged chunks to a device, as fastsafetensors and Run:ai's streamer make them.

    Overlap (``lane``, a ``CudaLane`` class): each reader thread fills two host buffers in turn (pinned on CUDA)
    and submits each chunk's copy to its own lane without waiting, so it reads the next chunk into the other buffer
    while the copy runs; a buffer is handed out again only after the mark recorded after its last copy has been
    reached. Host staging is then 2 x chunk per thread. Without a lane: one buffer and blocking copies, as
    ``Staging`` makes them.

    ``convert_on_device``: a chunk whose dtype changes, or whose runs are strided, goes to the device as its stored
    bytes, into one reused device buffer per thread, and a kernel there converts and gathers it into ``out``. A
    blocking ``copy_`` across devices and dtypes converts on the host instead (ATen's ``copy_kernel_cuda``: into a
    pageable temporary, then copied); a non-blocking one converts on the device, but through a fresh device
    temporary per chunk, and still gathers strided runs on the host.

    The lane is a parameter so that the ordering runs on the CPU too (the tests give it a thread).
    """

    def __init__(self, stats: StreamStats, *, device: torch.device, lane: type | None, convert_on_device: bool):
        self._stats = stats
        self._device = torch.device(device)
        self._lane_type = lane
        self._depth = 2 if lane is not None else 1
        self._pinned = self._device.type == "cuda"
        self._convert = convert_on_device
        self._local = threading.local()
        self._lock = threading.Lock()
        self._lanes: list = []
        self._host_total = 0
        self._fence = None

    def get(self, nbytes: int) -> torch.Tensor:
        """This thread's next host buffer, of ``nbytes``, once the copies out of it have run."""
        mine = self._thread()
        mine.turn = (mine.turn + 1) % self._depth
        mark, mine.marks[mine.turn] = mine.marks[mine.turn], None
        if mark is not None:
            mark.synchronize()
        buf = mine.buffers[mine.turn]
        if buf is None or buf.numel() < nbytes:
            grown = max(nbytes, 1) - (buf.numel() if buf is not None else 0)
            buf = mine.buffers[mine.turn] = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self._pinned)
            with self._lock:
                self._host_total += grown
                self._stats.staged(self._host_total)
        return buf[:nbytes]

    def copy(self, out: torch.Tensor, stored: torch.Tensor) -> None:
        """``out.copy_(stored)``, ``stored`` a view of the buffer this thread's last ``get`` returned."""
        mine = self._thread()
        if self._convert and stored.numel() and (stored.dtype != out.dtype or not stored.is_contiguous()):
            copy = functools.partial(self._through_device, mine, out, stored, mine.buffers[mine.turn])
        else:
            copy = functools.partial(out.copy_, stored, non_blocking=mine.lane is not None)
        if mine.lane is None:
            copy()
            return
        fence = self._fence
        if fence is not None and mine.fenced is not fence:
            mine.lane.after(fence)
            mine.fenced = fence
        mine.lane.submit(copy)
        mine.marks[mine.turn] = mine.lane.mark()

    def fence(self) -> None:
        """Destinations were just allocated on the calling thread's current stream, maybe in blocks its pending work
        still reads (freed there, reused at once): the lanes' next copies wait for that work on the device."""
        if self._lane_type is not None:
            self._fence = self._lane_type.fence(self._device)

    def publish(self) -> None:
        """Every copy submitted so far is visible to the calling thread's current stream (a wait on the device)."""
        for lane in self._all_lanes():
            lane.publish()

    def synchronize(self) -> None:
        """Wait until every copy submitted so far has run."""
        for lane in self._all_lanes():
            lane.synchronize()

    def _all_lanes(self) -> list:
        with self._lock:
            return list(self._lanes)

    def _thread(self) -> _Thread:
        mine = getattr(self._local, "state", None)
        if mine is None:
            lane = self._lane_type(self._device) if self._lane_type is not None else None
            mine = self._local.state = _Thread(self._depth, lane)
            if lane is not None:
                with self._lock:
                    self._lanes.append(lane)
        return mine

    def _through_device(self, mine: _Thread, out: torch.Tensor, stored: torch.Tensor, host: torch.Tensor) -> None:
        """The bytes of ``host`` (the buffer ``stored`` views) that ``stored`` spans, as they are, into the thread's
        device buffer; converted and gathered into ``out`` there."""
        itemsize = stored.element_size()
        first = stored.storage_offset() * itemsize
        span = (1 + sum((n - 1) * step for n, step in zip(stored.shape, stored.stride()))) * itemsize
        if mine.device_buf is None or mine.device_buf.numel() < span:
            grown = span - (mine.device_buf.numel() if mine.device_buf is not None else 0)
            # allocated on the lane's stream (``submit``): only later work on that stream reuses its blocks
            mine.device_buf = torch.empty(span, dtype=torch.uint8, device=self._device)
            with self._lock:
                self._stats.device_staged(grown)
        raw = mine.device_buf[:span]
        raw.copy_(host[first : first + span], non_blocking=mine.lane is not None)
        out.copy_(raw.view(stored.dtype).as_strided(stored.shape, stored.stride()))


@dataclass
class _Thread:
    """One reader thread's part of a ``CopyRing``: its host buffers, the mark after each one's last copy, the
    buffer in use, its device buffer and the lane its copies run on (None: blocking copies)."""

    depth: int
    lane: Any
    turn: int = 0
    buffers: list = field(default_factory=list)
    marks: list = field(default_factory=list)
    device_buf: torch.Tensor | None = None
    fenced: Any = None

    def __post_init__(self):
        self.buffers, self.marks = [None] * self.depth, [None] * self.depth


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
    named error, where a mapping of it would kill the process with SIGBUS.
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

    def fence(self, device: torch.device) -> None:
        self._staging.fence(device)

    def publish(self) -> None:
        self._staging.publish()

    def close(self) -> None:
        self._staging.close()


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
