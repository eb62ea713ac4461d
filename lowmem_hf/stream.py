"""Stream: read each planned tensor straight into memory of its final dtype and device, submodule by submodule.

Readers, one per storage format, share one contract: ``jobs(info, dst, shard)`` returns independent chunk
reads that together fill ``dst`` (already of the decided dtype and device) with the stored tensor or this
rank's slice of it, converting on the fly, and ``done(info, nbytes)`` accounts for it; nothing of the file
stays mapped or buffered afterwards. The chunks of one submodule run on a small thread pool.

- safetensors: ``preadv`` of the slice's byte ranges (or HTTP ranges, see ``fetch.HttpRanges``). Same dtype
  on CPU: straight into the destination's memory, no staging at all. Otherwise: through one reused staging
  buffer of ``chunk_bytes`` per worker thread (pinned when the destination is a CUDA device), converted by
  ``copy_`` chunk by chunk.
- torch zip (``.bin`` since torch 1.6): ``torch.load(mmap=True, weights_only=...)`` one shard at a time,
  copied chunk by chunk; each chunk's pages are dropped from the mapping right after (``madvise``), so
  the resident file-backed memory stays one chunk, not one shard.
- legacy torch pickle: has no random access; the shard is loaded whole (the report says what it cost).
"""

from __future__ import annotations

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

__all__ = ["StreamStats", "stream", "chunk_spans", "slice_tensor", "staging_chunk_bytes", "DEFAULT_CHUNK_BYTES", "DEFAULT_WORKERS"]

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# Chunks of one submodule are read by this many threads: preadv and copy_ release the GIL, so reading one
# chunk overlaps converting another. More threads than cores only add contention.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
# Linux returns at most this many bytes from one read/preadv call.
_MAX_SYSCALL_BYTES = 0x7FFFF000
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

    def read(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.on_read is not None:
            self.on_read(nbytes)

    def opened(self, path: str) -> None:
        if path not in self.files_read:
            self.files_read.append(path)

    def staged(self, nbytes: int) -> None:
        self.staging_bytes = max(self.staging_bytes, nbytes)


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
    """Byte source over local files: ``preadv``, one descriptor per file, closed after the file's last tensor."""

    def __init__(self, paths: Mapping[str, str] | None = None):
        self._paths = paths or {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def read(self, file: str, view: memoryview, offset: int) -> None:
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = os.open(self._paths.get(file, file), os.O_RDONLY)
        _pread_exact(fd, view, offset, file)

    def release(self, file: str) -> None:
        fd = self._fds.pop(file, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class SafetensorsReader:
    """Reads safetensors tensors (or slices of them) from a byte source: local files or HTTP ranges."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, stats: StreamStats, source=None):
        self._remaining = dict(plan_counts)
        self._source = source if source is not None else LocalFiles()
        self._staging = _Staging(stats)
        self._chunk_bytes = chunk_bytes
        self._stats = stats

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        """Independent chunk reads that together fill ``dst`` with the tensor (or its ``shard`` slice).

        Only the slice's bytes are read: a dim-0 slice is one byte range, a slice of another dim one range
        per leading index. Safe to run on several threads at once.
        """
        self._stats.opened(info.file)
        source, itemsize = self._source, info.dtype.itemsize
        chunks = chunk_runs(element_runs(info.shape, shard), itemsize, self._chunk_bytes)
        if dst.device.type == "cpu" and dst.dtype == info.dtype and dst.is_contiguous():
            view = _byte_view(dst)

            def direct(chunk: list[tuple[int, int, int]]) -> None:
                for src, at, n in chunk:
                    source.read(info.file, view[at * itemsize : (at + n) * itemsize], info.offset + src * itemsize)

            return [functools.partial(direct, c) for c in chunks]

        flat = dst.view(-1)
        pinned = dst.device.type == "cuda"

        def staged(chunk: list[tuple[int, int, int]]) -> None:
            total = sum(n for _, _, n in chunk)
            buf = self._staging.get(total * itemsize, pinned=pinned)
            bytes_view, pos = _byte_view(buf), 0
            for src, _, n in chunk:
                source.read(info.file, bytes_view[pos : pos + n * itemsize], info.offset + src * itemsize)
                pos += n * itemsize
            first = chunk[0][1]  # the runs of a chunk are consecutive in the destination
            flat[first : first + total].copy_(buf.view(info.dtype))

        return [functools.partial(staged, c) for c in chunks]

    def done(self, info: TensorInfo, nbytes: int) -> None:
        """Account one finished tensor (``nbytes`` read); release its file after the last one."""
        self._stats.read(nbytes)
        self._remaining[info.file] -= 1
        if self._remaining[info.file] == 0:
            self._source.release(info.file)

    def close(self) -> None:
        self._source.close()


def _release_pages(t: torch.Tensor) -> None:
    """Drop a mmapped CPU tensor's pages from this process's resident set (they stay in the page cache).

    Written by hand because torch offers no way to unmap part of a ``torch.load(mmap=True)`` mapping; the
    mapping is private and never written, so the kernel re-reads a dropped page from the file if touched again.
    """
    start = t.data_ptr()
    length = t.numel() * t.element_size()
    if length == 0:
        return
    page = mmap.PAGESIZE
    aligned = start - start % page
    _libc().madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(length + (start - aligned)), _MADV_DONTNEED)


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


class TorchReader:
    """Reads ``torch.save`` shards: one shard loaded at a time (mmapped for zip archives, whole for legacy pickles)."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, weights_only: bool, stats: StreamStats, paths=None):
        self._paths = paths or {}
        self._remaining = dict(plan_counts)
        self._chunk_bytes = chunk_bytes
        self._weights_only = weights_only
        self._stats = stats
        self._file: str | None = None
        self._state: dict[str, torch.Tensor] | None = None
        self._mmapped = False

    def _load(self, file: str) -> dict[str, torch.Tensor]:
        if self._file != file:
            self.close()
            path = self._paths.get(file, file)
            self._mmapped = zipfile.is_zipfile(path)
            self._state = torch.load(path, map_location="cpu", weights_only=self._weights_only, mmap=self._mmapped)
            self._file = file
            self._stats.opened(file)
            if not self._mmapped:
                size = os.path.getsize(path)
                self._stats.staged(size)
                self._stats.notes.append(
                    f"{path} is a legacy (non-zip) torch pickle: it was loaded whole, costing {size} bytes "
                    "of host memory at once. Re-save it with torch.save (torch>=1.6) or as safetensors to stream it."
                )
        return self._state

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        full = self._load(info.file)[info.key]
        src = slice_tensor(full, shard)
        if not (self._mmapped and src.is_contiguous()):

            def whole() -> None:
                dst.copy_(src)
                if self._mmapped and full.is_contiguous():
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
            self.close()

    def close(self) -> None:
        # Dropping the last reference to the loaded state unmaps the file (zip) or frees it (legacy).
        self._state = None
        self._file = None


def _reader(fmt: str, counts: dict[str, int], chunk_bytes: int, weights_only: bool, stats: StreamStats, paths, source):
    if fmt == CheckpointFormat.DCP:  # sharded training checkpoints: ``source`` is the checkpoint's layout
        from .dcp import DcpReader

        return DcpReader(source, chunk_bytes, stats)
    if fmt == CheckpointFormat.SAFETENSORS:
        return SafetensorsReader(counts, chunk_bytes, stats, source if source is not None else LocalFiles(paths))
    return TorchReader(counts, chunk_bytes, weights_only, stats, paths)


def stream(
    plan: LoadPlan,
    *,
    checkpoint_format: str,
    device: torch.device,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    weights_only: bool = True,
    workers: int = DEFAULT_WORKERS,
    stats: StreamStats,
    paths: Mapping[str, str] | None = None,
    source=None,
) -> Iterator[tuple[SubmodulePlan, dict[str, torch.Tensor], list[tuple[ConversionRead, list[torch.Tensor]]]]]:
    """Yield, per submodule in plan order, its loaded tensors (final dtype/device) and its staged converter inputs.

    ``paths`` maps a ``TensorInfo.file`` to where it is on disk (Hub loads: the HF cache); ``source``
    replaces local reads of safetensors bytes (``fetch.HttpRanges``). The caller assigns each submodule before asking for the next; nothing is kept here between submodules
    except the staging buffer and open file handles (closed after each file's last read, and on exit).
    """
    counts: dict[str, int] = {}
    for sub in plan.submodules:
        for r in sub.reads:
            counts[r.source.file] = counts.get(r.source.file, 0) + 1
        for c in sub.conversions:
            for _, info in c.sources:
                counts[info.file] = counts.get(info.file, 0) + 1
    reader = _reader(checkpoint_format, counts, chunk_bytes, weights_only, stats, paths, source)
    workers = getattr(source, "workers", workers)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowmem-read") if workers > 1 else None

    def fill(pairs: list[tuple[TensorInfo, torch.Tensor, ShardSpec | None]]) -> None:
        """Read every (source, destination, slice), chunks spread over the pool; files close in order after."""
        jobs = [job for info, dst, shard in pairs for job in reader.jobs(info, dst, shard)]
        if pool is None:
            for job in jobs:
                job()
        else:
            for future in [pool.submit(job) for job in jobs]:
                future.result()  # re-raises the first error, e.g. a file truncated mid-load
        for info, dst, _ in pairs:
            reader.done(info, dst.numel() * info.dtype.itemsize)

    try:
        for sub in plan.submodules:
            tensors = {r.target: torch.empty(r.local_shape, dtype=r.decision.dtype, device=device) for r in sub.reads}
            staged = []
            pairs = [(r.source, tensors[r.target], r.shard) for r in sub.reads]
            for c in sub.conversions:
                # transformers converts on the sources cast to the target dtype; stage exactly that.
                inputs = [torch.empty(i.shape, dtype=c.decision.dtype, device=device) for _, i in c.sources]
                pairs += [(info, dst, None) for (_, info), dst in zip(c.sources, inputs)]
                stats.staged(sum(t.numel() * t.element_size() for t in inputs))
                staged.append((c, inputs))
            fill(pairs)
            yield sub, tensors, staged
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        reader.close()
