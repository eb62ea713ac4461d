"""Staging: the host buffers a reader fills when a chunk cannot land in place, and the copies out of them into the
destination (``Staging``); onto a CUDA device, copies that overlap the reads and convert on the device (``CopyRing``
over one side stream per reader thread, ``CudaLane``)."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import settings
from .stats import StreamStats

__all__ = ["CopyRing", "CudaLane", "Staging"]


class Staging:
    """Host buffers for chunks that cannot land in place (dtype change, or a device destination), and the copies out
    of them: host staging is ``workers x chunk_bytes`` at most, whatever the model size.

    A CPU destination, or a CUDA one with both switches off (``settings.gpu_overlap``, ``gpu_convert_on_device``):
    one reused buffer per worker thread (pinned for CUDA) and a plain ``copy_``, which blocks. A CUDA destination
    otherwise goes through a ``CopyRing``: with overlap, two buffers per thread and copies that do not block the next
    read; converting on the device, one device buffer per thread.
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
                    self._stats, device=device, lane=CudaLane, depth=2 if self._overlap else 1, convert_on_device=self._convert,
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

    Each reader thread fills ``depth`` host buffers in turn (pinned on CUDA) and submits each chunk's copy to its own
    lane (``lane``: ``CudaLane``, a side stream) without waiting; a buffer is handed out again only after the mark
    recorded after its last copy has been reached. ``depth=2`` overlaps: the thread reads the next chunk into the
    other buffer while the copy runs, and host staging is 2 x chunk per thread. ``depth=1``: the next read waits for
    the copy, as a blocking ``copy_`` would.

    ``convert_on_device``: a chunk whose dtype changes, or whose runs are strided, goes to the device as its stored
    bytes, into one reused device buffer per thread, and a kernel there converts and gathers it into ``out``. A
    blocking ``copy_`` across devices and dtypes converts on the host instead (ATen's ``copy_kernel_cuda``: into a
    pageable temporary, then copied); a non-blocking one converts on the device, but through a fresh device
    temporary per chunk, and gathers a strided band that changes dtype on the host first.

    The lane is a parameter so that the ordering runs on the CPU too (the tests give it a thread).
    """

    def __init__(self, stats: StreamStats, *, device: torch.device, lane: type, depth: int, convert_on_device: bool):
        self._stats = stats
        self._device = torch.device(device)
        self._lane_type = lane
        self._depth = depth
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
            copy = functools.partial(out.copy_, stored, non_blocking=True)
        fence = self._fence
        if fence is not None and mine.fenced is not fence:
            mine.lane.after(fence)
            mine.fenced = fence
        mine.lane.submit(copy)
        mine.marks[mine.turn] = mine.lane.mark()

    def fence(self) -> None:
        """Destinations were just allocated on the calling thread's current stream, maybe in blocks its pending work
        still reads (freed there, reused at once): the lanes' next copies wait for that work on the device."""
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
            lane = self._lane_type(self._device)
            mine = self._local.state = _Thread(self._depth, lane)
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
        raw.copy_(host[first : first + span], non_blocking=True)
        out.copy_(raw.view(stored.dtype).as_strided(stored.shape, stored.stride()))


@dataclass
class _Thread:
    """One reader thread's part of a ``CopyRing``: its host buffers, the mark after each one's last copy, the
    buffer in use, its device buffer and the lane its copies run on."""

    depth: int
    lane: Any
    turn: int = 0
    buffers: list = field(default_factory=list)
    marks: list = field(default_factory=list)
    device_buf: torch.Tensor | None = None
    fenced: Any = None

    def __post_init__(self):
        self.buffers, self.marks = [None] * self.depth, [None] * self.depth
