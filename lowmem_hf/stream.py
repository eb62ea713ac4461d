"""Stream: read each planned tensor straight into memory of its final dtype and device, submodule by submodule.

Readers, one per storage format, share one contract: ``jobs(info, dst, shard)`` returns independent chunk
reads that together fill ``dst`` (already of the decided dtype and device) with the stored tensor or this
rank's slice of it, converting on the fly, and ``done(info, nbytes)`` accounts for it; nothing of the file
stays mapped or buffered afterwards (except ``mmap=True`` views, which are the parameters).

Pipelining: the chunks run on a small thread pool, and the reads of the next submodules are submitted while
the current one is assigned, up to ``read_ahead_bytes`` of reads in flight beyond it; each submodule's byte
ranges are also announced to the kernel (``posix_fadvise(WILLNEED)``) as it enters that window when the
files are not in the page cache, so a cold disk is kept busy. Destinations are the final model's memory, so reading ahead costs no staging; submodules
are still yielded (and assigned) strictly in plan order.

- safetensors: ``preadv`` of the slice's byte ranges (or HTTP ranges, see ``fetch.HttpRanges``). Same dtype
  on CPU: straight into the destination's memory, no staging at all. Otherwise: through one reused staging
  buffer of ``chunk_bytes`` per worker thread (pinned when the destination is a CUDA device), converted by
  ``copy_`` chunk by chunk. (Converting straight from a mapping of the file saves that copy; on the 2 GB
  fp32 -> bf16 load, page-cache warm, it measured slower one day (0.75-0.83 s against 0.69-0.71 s) and 4-9%
  faster another (streaming 0.47-0.50 s against 0.51-0.53 s). Not used: a file truncated while it is mapped
  kills the process with SIGBUS, where ``preadv`` raises the named error.) With ``mmap=True`` no tensor is
  read at all: each becomes a copy-on-write view of its file, as in transformers (``check_mmap``).
- torch zip (``.bin`` since torch 1.6): ``torch.load(mmap=True, weights_only=...)`` once per shard (kept
  mapped until its last planned tensor is read), copied chunk by chunk; each chunk's pages are dropped from
  the mapping right after (``madvise``), so the resident file-backed memory stays a chunk per reader thread,
  not a shard. From a cold disk each tensor's pages are announced (``madvise(WILLNEED)``) as it enters the
  read-ahead window (``bench_usable.py``, 2 GB fp32 -> bf16, one process, cold: 1.07x transformers against
  1.20x and 1.35x without).
- legacy torch pickle: has no random access; the shard is loaded whole (the report says what it cost).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import math
import mmap
import os
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

import torch

from .errors import CorruptCheckpointError
from .plan.sharding import chunk_runs, element_runs
from .types import CheckpointFormat, ConversionRead, LoadPlan, ShardSpec, SubmodulePlan, TensorInfo

__all__ = [
    "StreamStats", "stream", "chunk_spans", "slice_tensor", "staging_chunk_bytes", "choose_workers", "cached_fraction", "check_mmap",
    "DEFAULT_CHUNK_BYTES", "DEFAULT_WORKERS", "DEFAULT_READ_AHEAD_BYTES", "GAP_BYTES",
]

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_READ_AHEAD_BYTES = 64 * 1024 * 1024
# Chunks are read by this many threads when the files are in the page cache: preadv and copy_ release the
# GIL, so reading one chunk overlaps converting another; more threads than cores only add contention.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
# From a cold disk the threads mostly wait on I/O: more of them keep more requests queued. The ranks of a
# node share its cores (torchrun's LOCAL_WORLD_SIZE), so each gets its part.
COLD_WORKERS = max(DEFAULT_WORKERS, min(8, 4 * (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
# Linux returns at most this many bytes from one read/preadv call.
_MAX_SYSCALL_BYTES = 0x7FFFF000
# Linux's IOV_MAX: buffers one preadv call may fill.
_IOV_MAX = 1024
# Files in the page cache: runs of a slice separated by at most this many bytes are read by one call, the gap
# copied and dropped. Copying 32 KiB out of the page cache costs about what one more syscall does; a 2-rank
# row-wise slice of a 2048-wide fp32 matrix is 2048 runs of 4 KiB with 4 KiB gaps (one call per band of rows
# instead of 2048). Measured, 2 GB fp32 Llama -> bf16, tp_rank 0 of 2 in one process, warm: 0.57-0.79 s against
# 0.92-1.27 s with a call per row. Never from a cold disk: there a gap is bytes read from the device for nothing.
GAP_BYTES = 32 * 1024
_MADV_WILLNEED = 3
_MADV_DONTNEED = 4


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
    gap_bytes: int = 0
    """Local files in the page cache: bytes copied between the runs of sliced tensors and dropped."""

    def read(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.on_read is not None:
            self.on_read(nbytes)

    def opened(self, path: str) -> None:
        if path not in self.files_read:
            self.files_read.append(path)

    def staged(self, nbytes: int) -> None:
        self.staging_bytes = max(self.staging_bytes, nbytes)


def cached_fraction(paths: list[str]) -> float | None:
    """Fraction of the files' pages that are in the page cache (``mincore`` on a mapping), None if unknown.

    Written by hand: Python exposes no ``mincore``; the answer decides whether the load is I/O-bound (more
    reader threads, read-ahead hints). Mapping a file maps no page in; sampling keeps the question ~0.1 ms per file.
    """
    libc, page, resident, total = _libc(), mmap.PAGESIZE, 0, 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                # 64 windows of 16 pages spread over the file: a whole-file mincore walks every page (~35 ms for 2 GB)
                npages = (size + page - 1) // page
                window = min(16, npages)
                vec = ctypes.create_string_buffer(window)
                for start in sorted({(npages - window) * i // 63 for i in range(64)}):
                    if libc.mincore(ctypes.c_void_p(address + start * page), ctypes.c_size_t(window * page), vec) != 0:
                        return None
                    resident += window - vec.raw.count(0)  # the low bit of each byte: page resident
                    total += window
            finally:
                libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
        finally:
            os.close(fd)
    return resident / total if total else None


def choose_workers(cached: float | None) -> int:
    """Reader threads for a load whose files are ``cached`` (fraction in the page cache; None: unknown)."""
    return DEFAULT_WORKERS if cached is None or cached >= 0.9 else COLD_WORKERS


def check_mmap(plan: LoadPlan, *, checkpoint_format: str, local: bool, device: torch.device) -> None:
    """Raise ``ValueError`` unless every tensor ``plan`` reads can be a copy-on-write view of its file (``mmap=True``).

    A view needs a local safetensors file, a CPU destination, the stored dtype, a slice that is one contiguous run
    and an offset aligned to the dtype; where one tensor cannot be, the request cannot be kept as asked, so it is
    refused before any byte is read (copying those tensors instead would quietly give a different memory profile).
    """
    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"mmap=True leaves every loaded tensor as a copy-on-write view of its checkpoint file, but {what}. {fix}")

    if torch.device(device).type != "cpu":
        refuse(f"device={device} is not host memory", "Load on cpu with mmap=True, or drop mmap=True to copy onto the device.")
    if checkpoint_format != CheckpointFormat.SAFETENSORS:
        refuse(f"the checkpoint is {checkpoint_format}, not safetensors", "Convert it to safetensors, or drop mmap=True.")
    if not local:
        refuse("fetch='ranges' reads the Hub files into memory, not into local files", "Pass fetch='files' (into the HF cache) or drop mmap=True.")

    def listed(reads: list, describe: Callable) -> str:
        more = f" and {len(reads) - 3} more" if len(reads) > 3 else ""
        return ", ".join(f"{r.target} ({describe(r)})" for r in reads[:3]) + more

    converted = [r for r in plan.reads if r.decision.dtype != r.source.dtype]
    if converted:
        names = listed(converted, lambda r: f"stored {r.source.dtype}, loaded {r.decision.dtype} by rule {r.decision.rule!r}")
        refuse(f"{len(converted)} tensor(s) change dtype: {names}", "Pass torch_dtype='auto' (or the stored dtype), or drop mmap=True.")
    strided = [r for r in plan.reads if len(element_runs(r.source.shape, r.shard)) > 1]
    if strided:
        names = listed(strided, lambda r: f"sliced along dim {r.shard.dim}" if r.shard.intervals is None else f"mesh slice {r.shard.intervals}")
        refuse(
            f"{len(strided)} tensor-parallel slice(s) are not one contiguous range of the file: {names}",
            "Drop mmap=True for this tensor-parallel load (only dim-0 slices are contiguous).",
        )
    misaligned = [r for r in plan.reads if r.source.offset is None or r.source.offset % r.source.dtype.itemsize]
    if misaligned:
        r = misaligned[0]
        refuse(
            f"{r.source.key} in {r.source.file} starts at byte {r.source.offset}, not a multiple of its {r.source.dtype.itemsize}-byte dtype",
            "Re-save the checkpoint with a current safetensors (it aligns every tensor), or drop mmap=True.",
        )
    groups = [c for s in plan.submodules for c in s.conversions]
    if groups:
        refuse(
            f"transformers merges checkpoint tensors into {len(groups)} new tensor(s) (first: {groups[0].first_target})",
            "Drop mmap=True for this model.",
        )


def chunk_spans(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` covering ``numel`` elements, each at most ``chunk_bytes`` bytes (min one element)."""
    step = max(1, chunk_bytes // itemsize)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def staging_chunk_bytes(plan: LoadPlan, chunk_bytes: int, workers: int = DEFAULT_WORKERS) -> int:
    """``chunk_bytes``, lowered so the staging buffers (``workers`` x chunk) stay within 1/128 of the bytes this
    process loads (at least 256 KiB): a rank holding a quarter of a model should not pay full-model staging."""
    local = sum(math.prod(r.local_shape) * r.decision.dtype.itemsize for r in plan.reads)
    return min(chunk_bytes, max(256 << 10, local // (128 * workers)))


def slice_tensor(t: torch.Tensor, shard: ShardSpec | None) -> torch.Tensor:
    """``t``'s slice described by ``shard``: a view for one range per dim, a copy where a dim has several runs."""
    if shard is None:
        return t
    if shard.intervals is None:
        return t.narrow(shard.dim, shard.start, shard.stop - shard.start)
    for dim, runs in enumerate(shard.intervals):
        if runs == ((0, t.shape[dim]),):
            continue
        if len(runs) == 1:
            t = t.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        else:  # several runs (a strided shard) or none (an uneven shard that left this rank nothing)
            t = torch.cat([t.narrow(dim, a, b - a) for a, b in runs], dim=dim) if runs else t.narrow(dim, 0, 0)
    return t


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (for ``preadv``)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _MAX_SYSCALL_BYTES]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path}: expected {len(view)} bytes at offset {offset}, the file ended after {done}. "
                "It was truncated while loading: copy it again."
            )
        done += n


class _Staging:
    """One reusable host buffer per worker thread for chunks that cannot land in place (dtype change, or a
    device destination): host staging is ``workers x chunk_bytes`` at most, whatever the model size."""

    def __init__(self, stats: StreamStats):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._total = 0
        self._stats = stats

    def get(self, nbytes: int, *, pinned: bool) -> torch.Tensor:
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


class LocalFiles:
    """Byte source over local files: ``preadv``, one descriptor per file, closed after the file's last tensor.

    Also what only a local file offers: a private mapping of the file (``mapping``) that ``mmap=True`` leaves
    as the tensors, and read-ahead hints (``will_need``).
    """

    def __init__(self, paths: Mapping[str, str] | None = None, *, gap_bytes: int = 0):
        self._paths = paths or {}
        self._gap = gap_bytes
        self.gap_bytes_read = 0
        """Bytes read between runs and dropped (``read_runs``): page-cache copies, no device I/O."""
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._kept: set[str] = set()
        self._lock = threading.Lock()
        self._thread = threading.local()  # per reader thread: the scratch buffer gaps are read into

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = os.open(self._paths.get(file, file), os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger kernel read-ahead window
                    self._fds[file] = fd
        return fd

    def read(self, file: str, view: memoryview, offset: int) -> None:
        _pread_exact(self._fd(file), view, offset, file)

    def read_runs(self, file: str, parts: list[tuple[memoryview, int]]) -> None:
        """Fill each ``(view, offset)`` of ``parts`` (ascending, non-overlapping offsets) from ``file``.

        Runs at most ``gap_bytes`` apart (the constructor's; 0: none) share one ``preadv``, the bytes between
        them read into a per-thread scratch buffer and dropped: a dim-1 slice is one run per row, and a syscall
        per row costs more than copying the other ranks' part of the row out of the page cache. Written by hand:
        nothing in the stack gathers file ranges.
        """
        fd = self._fd(file)
        scratch = self._scratch() if self._gap else None
        i, dropped = 0, 0
        while i < len(parts):
            view, offset = parts[i]
            buffers, end, j, gaps = [view], offset + len(view), i + 1, 0
            while j < len(parts) and len(buffers) < _IOV_MAX - 1 and 0 <= parts[j][1] - end <= self._gap:
                gap = parts[j][1] - end
                if gap:
                    buffers.append(scratch[:gap])
                    gaps += gap
                buffers.append(parts[j][0])
                end = parts[j][1] + len(parts[j][0])
                j += 1
            if j == i + 1 or end - offset > _MAX_SYSCALL_BYTES or os.preadv(fd, buffers, offset) != end - offset:
                for k in range(i, j):  # one run, or a short read (the file ended): run by run, naming the cut
                    _pread_exact(fd, parts[k][0], parts[k][1], file)
            dropped += gaps
            i = j
        self.count_gap(dropped)

    @property
    def gap_bytes_allowed(self) -> int:
        """Largest gap between two runs read through by one call (0: each run is its own read)."""
        return self._gap

    def count_gap(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self.gap_bytes_read += nbytes

    def _scratch(self) -> memoryview:
        buf = getattr(self._thread, "scratch", None)
        if buf is None:
            buf = self._thread.scratch = memoryview(bytearray(self._gap))
        return buf

    def mapping(self, file: str, *, kept: bool = False) -> mmap.mmap:
        """A private (copy-on-write) mapping of the whole file: reading it maps page-cache pages, no copy.

        ``kept``: tensors made from it outlive the load (``mmap=True``), so it is never closed here; each such
        tensor holds a reference to the mapping object, which unmaps when the last of them is freed.
        """
        if kept:
            self._kept.add(file)
        mm = self._maps.get(file)
        if mm is None:
            fd = self._fd(file)
            with self._lock:
                mm = self._maps.get(file)
                if mm is None:
                    mm = self._maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        return mm

    def will_need(self, file: str, start: int, stop: int) -> None:
        """Ask the kernel to start reading ``[start, stop)`` of ``file`` now (asynchronously)."""
        if hasattr(os, "posix_fadvise") and stop > start:
            os.posix_fadvise(self._fd(file), start, stop - start, os.POSIX_FADV_WILLNEED)

    def release(self, file: str) -> None:
        mm = self._maps.pop(file, None)
        if mm is not None and file not in self._kept:
            mm.close()  # nothing was made from it (torch.frombuffer holds no buffer export that would stop this)
        fd = self._fds.pop(file, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for file in list(self._fds):
            self.release(file)


class SafetensorsReader:
    """Reads safetensors tensors (or slices of them) from a byte source: local files or HTTP ranges."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, stats: StreamStats, source=None, *, mmap: bool = False):
        self._remaining = dict(plan_counts)
        self._source = source if source is not None else LocalFiles()
        self._local = isinstance(self._source, LocalFiles)
        self._staging = _Staging(stats)
        self._chunk_bytes = chunk_bytes
        self._stats = stats
        self._mmap = mmap

    def view(self, info: TensorInfo, dtype: torch.dtype, shape: tuple[int, ...], shard: ShardSpec | None, device) -> torch.Tensor | None:
        """``mmap=True``: the tensor as a copy-on-write view of its file; None without ``mmap=True``.

        Possible for a local file, a CPU destination of the stored dtype, a slice that is one contiguous run
        and an offset aligned to the dtype; ``check_mmap`` refused any other request before the stream began.
        Each view is its own storage (``torch.frombuffer``), so tied-weight detection and ``save_pretrained``
        see separate tensors, as with transformers' own mmap loads.
        """
        if not self._mmap:
            return None
        runs = element_runs(info.shape, shard)
        if not runs:  # nothing stored for this rank (an empty tensor or an empty uneven slice)
            return torch.empty(shape, dtype=dtype, device=device)
        [(src, n)], itemsize = runs, info.dtype.itemsize  # one run: check_mmap refused strided slices
        self._stats.opened(info.file)
        mm = self._source.mapping(info.file, kept=True)
        t = torch.frombuffer(mm, dtype=info.dtype, count=n, offset=info.offset + src * itemsize)
        self._stats.mapped_bytes += n * itemsize
        return t.view(shape)

    def hint(self, info: TensorInfo, shard: ShardSpec | None) -> None:
        """Announce the bytes this tensor (slice) will need, so a cold file is read ahead of the workers."""
        if not self._local:
            return
        runs = element_runs(info.shape, shard)
        if not runs:
            return
        itemsize = info.dtype.itemsize
        first, last = runs[0][0], runs[-1][0] + runs[-1][1]
        needed = sum(n for _, n in runs)
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
        if not self._local and len(runs) > 1 and max(n for _, n in runs) * itemsize <= self._chunk_bytes:
            return self._band_jobs(info, dst, runs)
        if self._local and self._source.gap_bytes_allowed and len(runs) > 1:
            jobs = self._strided_jobs(info, dst, runs)
            if jobs is not None:
                return jobs
        chunks = chunk_runs(runs, itemsize, self._chunk_bytes)
        if dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous():
            view = _byte_view(dst)

            def direct(chunk: list[tuple[int, int, int]]) -> None:
                if self._local:
                    source.read_runs(info.file, [(view[at * itemsize : (at + n) * itemsize], info.offset + src * itemsize) for src, at, n in chunk])
                    return
                for src, at, n in chunk:
                    source.read(info.file, view[at * itemsize : (at + n) * itemsize], info.offset + src * itemsize)

            return [functools.partial(direct, c) for c in chunks]

        flat = dst.view(-1)
        pinned = dst.device.type == "cuda"

        def staged(chunk: list[tuple[int, int, int]]) -> None:
            total = sum(n for _, _, n in chunk)
            buf = self._staging.get(total * itemsize, pinned=pinned)
            bytes_view, pos, parts = _byte_view(buf), 0, []
            for src, _, n in chunk:
                parts.append((bytes_view[pos : pos + n * itemsize], info.offset + src * itemsize))
                pos += n * itemsize
            if self._local:
                source.read_runs(info.file, parts)
            else:
                for part, offset in parts:
                    source.read(info.file, part, offset)
            first = chunk[0][1]  # the runs of a chunk are consecutive in the destination
            flat[first : first + total].copy_(buf.view(info.dtype))

        return [functools.partial(staged, c) for c in chunks]

    def _strided_jobs(self, info: TensorInfo, dst: torch.Tensor, runs: list[tuple[int, int]]) -> list[Callable[[], None]] | None:
        """Local files in the page cache, a slice that is equal runs at a fixed stride (a dim-1 slice: one run
        per row): bands of whole rows, each one ``preadv`` into staging and one strided ``copy_`` (converting)
        into ``dst``. None where that does not apply (irregular runs, gaps over ``gap_bytes``, a row over
        ``chunk_bytes``). Per-run reads cost a syscall and some Python per row, and with two ranks on two cores
        that Python holds the GIL against the thread assigning; this path has none per row."""
        first, n = runs[0]
        stride = runs[1][0] - first
        itemsize = info.dtype.itemsize
        if (stride - n) * itemsize > self._source.gap_bytes_allowed or stride * itemsize > self._chunk_bytes or not dst.is_contiguous():
            return None
        if any(src != first + i * stride or m != n for i, (src, m) in enumerate(runs)):
            return None
        rows, per_band = len(runs), max(1, self._chunk_bytes // (stride * itemsize))
        flat, pinned, source = dst.view(-1), dst.device.type == "cuda", self._source

        def band(r0: int, r1: int) -> None:
            span = (r1 - r0 - 1) * stride + n  # through the last row's run, not its gap
            buf = self._staging.get(span * itemsize, pinned=pinned)
            source.read(info.file, _byte_view(buf), info.offset + (first + r0 * stride) * itemsize)
            stored = buf.view(info.dtype).as_strided((r1 - r0, n), (stride, 1))
            flat[r0 * n : r1 * n].view(r1 - r0, n).copy_(stored)
            source.count_gap((r1 - r0 - 1) * (stride - n) * itemsize)

        return [functools.partial(band, r, min(r + per_band, rows)) for r in range(0, rows, per_band)]

    def _band_jobs(self, info: TensorInfo, dst: torch.Tensor, runs: list[tuple[int, int]]) -> list[Callable[[], None]]:
        """HTTP: a slice of several runs (a dim-1 slice: one per row) is fetched as bands of whole rows, one request
        per band of at most ``chunk_bytes`` (or one run), and only its runs are kept. Per-row requests would cost
        one round trip per row; the bytes between the runs are the price, counted in ``band_extra_bytes``."""
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
            buf = self._staging.get((end - first) * itemsize, pinned=dst.device.type == "cuda")
            self._source.read(info.file, _byte_view(buf), info.offset + first * itemsize)
            stored = buf.view(info.dtype)
            for src, at, n in parts:
                flat[at : at + n].copy_(stored[src - first : src - first + n])

        self._stats.band_extra_bytes += sum((b[-1][0] + b[-1][2] - b[0][0]) * itemsize for b in bands) - dst.numel() * itemsize
        return [functools.partial(band, b) for b in bands]

    def done(self, info: TensorInfo, nbytes: int) -> None:
        """Account one finished tensor (``nbytes`` read); release its file after the last one."""
        self._stats.read(nbytes)
        self._remaining[info.file] -= 1
        if self._remaining[info.file] == 0:
            self._source.release(info.file)

    def close(self) -> None:
        self._stats.gap_bytes += getattr(self._source, "gap_bytes_read", 0)
        self._source.close()


def _release_pages(t: torch.Tensor) -> None:
    """Drop a mmapped CPU tensor's pages from this process's resident set (they stay in the page cache).

    Written by hand because torch offers no way to unmap part of a ``torch.load(mmap=True)`` mapping; the
    mapping is private and never written, so the kernel re-reads a dropped page from the file if touched again.
    """
    _advise(t.data_ptr(), t.numel() * t.element_size(), _MADV_DONTNEED)


def _advise(start: int, length: int, advice: int) -> None:
    """``madvise`` over the pages holding ``[start, start + length)`` of this process's memory."""
    if length == 0:
        return
    aligned = start - start % mmap.PAGESIZE
    _libc().madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length + (start - aligned)), advice)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC.mmap.restype = ctypes.c_void_p
        _LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        _LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return _LIBC


class TorchReader:
    """Reads ``torch.save`` shards: zip archives mmapped (each kept until its last planned tensor is read), legacy
    pickles loaded whole, one at a time."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, weights_only: bool, stats: StreamStats, paths=None):
        self._paths = paths or {}
        self._remaining = dict(plan_counts)
        self._chunk_bytes = chunk_bytes
        self._weights_only = weights_only
        self._stats = stats
        # Open shards by file. A mapped shard costs no memory beyond the pages being copied (each chunk's are
        # dropped after), so read-ahead into the next shard keeps the current one instead of unpickling it again
        # when a submodule's tensors come from both (it did: 7 torch.load calls for 5 shards of the 2 GB Llama).
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        # Which of them are mappings (zip) rather than whole pickles in memory, per file: a checkpoint may mix the
        # two, and dropping pages (``_release_pages``) of a legacy shard's heap memory would destroy it.
        self._mapped: set[str] = set()

    def _load(self, file: str) -> dict[str, torch.Tensor]:
        state = self._states.get(file)
        if state is None:
            path = self._paths.get(file, file)
            mapped = zipfile.is_zipfile(path)
            if mapped:
                self._mapped.add(file)
            else:
                self._states.clear()  # a legacy pickle is the whole shard in memory: never two at once
            state = self._states[file] = torch.load(path, map_location="cpu", weights_only=self._weights_only, mmap=mapped)
            self._stats.opened(file)
            if not mapped:
                size = os.path.getsize(path)
                self._stats.staged(size)
                self._stats.notes.append(
                    f"{path} is a legacy (non-zip) torch pickle: it was loaded whole, costing {size} bytes "
                    "of host memory at once. Re-save it with torch.save (torch>=1.6) or as safetensors to stream it."
                )
        return state

    def hint(self, info: TensorInfo, shard: ShardSpec | None) -> None:
        """Cold files: ask the kernel to read this tensor's (slice's) pages of the shard mapping now
        (``madvise(WILLNEED)``), as ``SafetensorsReader.hint`` does with file offsets, so the reader threads'
        page faults find them in flight instead of each starting its own small read."""
        full = self._load(info.file)[info.key]
        runs = element_runs(info.shape, shard)
        if info.file not in self._mapped or not runs or not full.is_contiguous():
            return
        itemsize, (first, _), (last, n) = info.dtype.itemsize, runs[0], runs[-1]
        if sum(m for _, m in runs) * 2 >= last + n - first:  # dense enough, as for safetensors
            _advise(full.data_ptr() + first * itemsize, (last + n - first) * itemsize, _MADV_WILLNEED)

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        full = self._load(info.file)[info.key]
        src = slice_tensor(full, shard)
        mapped = info.file in self._mapped  # decided now: the job runs after other shards may have been loaded
        if not (mapped and src.is_contiguous()):

            def whole() -> None:
                dst.copy_(src)
                if mapped and full.is_contiguous():
                    _release_pages(full)

            return [whole]
        s, d = src.reshape(-1), dst.view(-1)

        def chunk(start: int, stop: int) -> None:
            d[start:stop].copy_(s[start:stop])
            _release_pages(s[start:stop])

        return [functools.partial(chunk, a, b) for a, b in chunk_spans(src.numel(), info.dtype.itemsize, self._chunk_bytes)]

    def done(self, info: TensorInfo, nbytes: int) -> None:
        self._stats.read(nbytes)
        self._remaining[info.file] -= 1
        if self._remaining[info.file] == 0:
            self._states.pop(info.file, None)  # the last reference: unmaps the file (zip) or frees it (legacy)

    def close(self) -> None:
        self._states.clear()


def _reader(fmt: str, counts: dict[str, int], chunk_bytes: int, weights_only: bool, stats: StreamStats, paths, source, mmap: bool, gap_bytes: int):
    if fmt == CheckpointFormat.DCP:  # sharded training checkpoints: ``source`` is the checkpoint's layout
        from .dcp import DcpReader

        return DcpReader(source, chunk_bytes, stats)
    if fmt == CheckpointFormat.SAFETENSORS:
        return SafetensorsReader(counts, chunk_bytes, stats, source if source is not None else LocalFiles(paths, gap_bytes=gap_bytes), mmap=mmap)
    return TorchReader(counts, chunk_bytes, weights_only, stats, paths)


@dataclass
class _InFlight:
    """One submodule whose reads are submitted: its destinations, staged groups and pending chunk reads."""

    sub: SubmodulePlan
    tensors: dict[str, torch.Tensor]
    staged: list
    pairs: list
    futures: list
    nbytes: int


def stream(
    plan: LoadPlan,
    *,
    checkpoint_format: str,
    device: torch.device,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    weights_only: bool = True,
    workers: int = DEFAULT_WORKERS,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
    read_ahead_hints: bool = False,
    gap_bytes: int = 0,
    mmap: bool = False,
    stats: StreamStats,
    paths: Mapping[str, str] | None = None,
    source=None,
) -> Iterator[tuple[SubmodulePlan, dict[str, torch.Tensor], list[tuple[ConversionRead, list[torch.Tensor]]]]]:
    """Yield, per submodule in plan order, its loaded tensors (final dtype/device) and its staged converter inputs.

    ``paths`` maps a ``TensorInfo.file`` to where it is on disk (Hub loads: the HF cache); ``source``
    replaces local reads of safetensors bytes (``fetch.HttpRanges``). Reads of the following submodules are in
    flight while the caller assigns one, up to ``read_ahead_bytes`` beyond it (0: one submodule at a time);
    with ``read_ahead_hints`` (files not in the page cache) their byte ranges are also announced to the kernel.
    ``gap_bytes`` (files in the page cache): runs of a local slice at most this far apart are read by one call.
    ``mmap=True`` leaves every tensor as a copy-on-write view of its local safetensors file (``check_mmap``
    refused the plan otherwise). Nothing else is kept between submodules except the staging buffers, open files and
    mapped ``.bin`` shards (each released after its file's last read, and all on exit).
    """
    counts: dict[str, int] = {}
    for sub in plan.submodules:
        for r in sub.reads:
            counts[r.source.file] = counts.get(r.source.file, 0) + 1
        for c in sub.conversions:
            for _, info in c.sources:
                counts[info.file] = counts.get(info.file, 0) + 1
    reader = _reader(checkpoint_format, counts, chunk_bytes, weights_only, stats, paths, source, mmap, gap_bytes)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowmem-read") if workers > 1 else None
    hint = getattr(reader, "hint", None) if read_ahead_hints else None  # ~0.1 ms per call even when cached
    view = getattr(reader, "view", None)
    before = getattr(source, "before_submodule", None)  # the cooperative fetch runs its waves from here
    if getattr(source, "read_ahead", True) is False:
        read_ahead_bytes = 0

    def submit(sub: SubmodulePlan) -> _InFlight:
        if before is not None:
            before(sub.name)
        tensors, pairs = {}, []
        for r in sub.reads:
            mapped = view(r.source, r.decision.dtype, r.local_shape, r.shard, device) if view is not None else None
            if mapped is not None:
                tensors[r.target] = mapped
                reader.done(r.source, 0)
                continue
            tensors[r.target] = torch.empty(r.local_shape, dtype=r.decision.dtype, device=device)
            pairs.append((r.source, tensors[r.target], r.shard))
        staged = []
        for c in sub.conversions:
            # transformers converts on the sources cast to the target dtype; stage exactly that.
            inputs = [torch.empty(i.shape, dtype=c.decision.dtype, device=device) for _, i in c.sources]
            pairs += [(info, dst, None) for (_, info), dst in zip(c.sources, inputs)]
            stats.staged(sum(t.numel() * t.element_size() for t in inputs))
            staged.append((c, inputs))
        jobs = []
        for info, dst, shard in pairs:
            if hint is not None:
                hint(info, shard)
            jobs += reader.jobs(info, dst, shard)
        futures = [pool.submit(job) for job in jobs] if pool is not None else jobs
        return _InFlight(sub, tensors, staged, pairs, futures, _read_bytes(sub))

    def finish(item: _InFlight) -> None:
        if pool is None:
            for job in item.futures:
                job()
        else:
            for future in item.futures:
                future.result()  # re-raises the first error, e.g. a file truncated mid-load
        for info, dst, _ in item.pairs:
            reader.done(info, dst.numel() * info.dtype.itemsize)

    pending = collections.deque(plan.submodules)
    window: collections.deque[_InFlight] = collections.deque()
    ahead = 0  # bytes submitted beyond the submodule at the head of the window
    try:
        while pending or window:
            # queue the next submodules' reads behind the current one, within the budget (none without a pool)
            while pending and (not window or pool is not None and ahead + _read_bytes(pending[0]) <= read_ahead_bytes):
                item = submit(pending.popleft())
                ahead += item.nbytes if window else 0
                window.append(item)
            head = window.popleft()
            finish(head)
            if window:
                ahead -= window[0].nbytes  # the next one becomes the head
            yield head.sub, head.tensors, head.staged
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        reader.close()


def _read_bytes(sub: SubmodulePlan) -> int:
    """Bytes a submodule reads at most (the read-ahead budget counts these; ``mmap=True`` views read none)."""
    total = sum(math.prod(r.local_shape) * r.source.dtype.itemsize for r in sub.reads)
    return total + sum(math.prod(i.shape) * i.dtype.itemsize for c in sub.conversions for _, i in c.sources)
