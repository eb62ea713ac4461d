"""Local files: ``preadv`` into the reader's views, one descriptor per file, closed after the file's last read.

Also what only a local file offers: its path (for torch's own loader), a private mapping of it (``mmap=True``
leaves the tensors as views of it), read-ahead hints to the kernel, whether its pages are in the page cache
(``cached_fraction``), which decides how the stream reads (more threads and hints from a cold disk, reads
through gaps from a warm one), and, with ``mapped_reads``, windows of a file mapped while this process holds a
kernel read lease on it (``mapped``: a reader converts straight from the page cache, with no copy into staging;
``lease.py`` says why such a mapping cannot SIGBUS).

A file that changed while it was read is a named error: a read past its end says so, and when its last read is
done (``release``) its descriptor and its path must still name the same file, of the same size and modification
time, as when it was opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from typing import Iterator, Mapping

import torch

from ..errors import CorruptCheckpointError
from . import ByteSource
from .lease import MAX_MAPPED_BYTES, Lease, LeaseWatch

__all__ = ["LocalFiles", "GAP_BYTES", "cached_fraction", "release_pages", "will_need_pages"]

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
_MAP_FAILED = ctypes.c_void_p(-1).value


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


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``offset`` of ``fd`` (several calls where one returns less); a file that ends first is named."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _MAX_SYSCALL_BYTES]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(
                f"{path}: expected {len(view)} bytes at offset {offset}, the file ended after {done}. "
                "It was truncated while loading: copy it again."
            )
        done += n


class LocalFiles(ByteSource):
    """Byte source over local files: ``preadv``, one descriptor per file, closed after the file's last tensor.

    Also what only a local file offers: its path (``path``), a private mapping of the file (``mapping``) that
    ``mmap=True`` leaves as the tensors, and read-ahead hints (``will_need``).
    """

    def __init__(
        self, paths: Mapping[str, str] | None = None, *, gap_bytes: int = 0, mapped_reads: bool = False, watch_leases: bool = True,
        unmapped_reason: str = "mapped reads were not asked for",
    ):
        """``mapped_reads``: take a read lease on each file as it is opened and offer ``mapped`` windows of it while
        the lease holds (``watch_leases``: a thread gives a broken lease up at once; without it, the next read of
        the file does). ``unmapped_reason``: what ``preadv_reasons`` says of each file without ``mapped_reads``."""
        self._paths = paths or {}
        self._gap = gap_bytes
        self.gap_bytes_read = 0
        """Bytes read between runs and dropped (``read_runs``): page-cache copies, no device I/O."""
        self.preadv_bytes = 0
        self.preadv_reasons: dict[str, str] = {}
        self._leases: dict[str, Lease] = {}
        self._all_leases: list[Lease] = []
        self._watch = LeaseWatch(watch=watch_leases) if mapped_reads else None
        self._unmapped_reason = unmapped_reason
        self._identity: dict[str, tuple[int, int, int, int]] = {}
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
                    fd = os.open(self.path(file), os.O_RDONLY)
                    if hasattr(os, "posix_fadvise"):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger kernel read-ahead window
                    lease = self._watch.take(file, fd) if self._watch is not None else self._unmapped_reason
                    if isinstance(lease, Lease):
                        self._leases[file] = lease
                        self._all_leases.append(lease)
                    else:
                        self.preadv_reasons[file] = lease
                    self._identity[file] = _identity(os.fstat(fd))  # after the lease: no writer can change it now
                    self._fds[file] = fd
        return fd

    def path(self, file: str) -> str:
        """Where ``file`` is on disk (Hub loads: the HF cache)."""
        return self._paths.get(file, file)

    def read(self, file: str, view: memoryview, offset: int) -> None:
        _pread_exact(self._fd(file), view, offset, file)
        self._count_preadv(len(view))

    @property
    def mapped_lease_bytes(self) -> int:
        """Bytes read through ``mapped`` windows under read leases so far."""
        return sum(lease.mapped_bytes for lease in self._all_leases)

    @contextlib.contextmanager
    def mapped(self, file: str, start: int, stop: int) -> Iterator[torch.Tensor | None]:
        """Bytes ``[start, stop)`` of ``file`` as a read-only ``uint8`` tensor over a mapping of them, valid only
        inside the ``with`` block; None: read them with ``read`` instead (no lease on the file, the lease was broken
        by a writer, more than ``MAX_MAPPED_BYTES``, or beyond the size the file had when it was leased).

        The lease cannot be given up while the block runs, so no writer can cut a mapped page: no SIGBUS. The window
        is unmapped on exit, so a load holds mapped pages of at most one window per reader thread (``VmHWM``).
        """
        self._fd(file)
        lease = self._leases.get(file)
        if lease is None or stop > lease.size or stop - start > MAX_MAPPED_BYTES or stop <= start or not lease.enter():
            yield None
            return
        mapped = 0
        try:
            base = start - start % mmap.PAGESIZE
            libc = _libc()
            address = libc.mmap(None, stop - base, mmap.PROT_READ, mmap.MAP_SHARED, lease.fd, base)
            if address in (None, _MAP_FAILED):
                yield None
                return
            try:
                yield torch.frombuffer((ctypes.c_ubyte * (stop - start)).from_address(address + start - base), dtype=torch.uint8)
                mapped = stop - start
            finally:
                libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(stop - base))
        finally:
            lease.leave(mapped)

    def _count_preadv(self, nbytes: int) -> None:
        with self._lock:
            self.preadv_bytes += nbytes

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
        self._count_preadv(sum(len(view) for view, _ in parts))

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
        """Every read of ``file`` is done: give its lease up, check it is still the file that was opened, close it.

        Raises:
            CorruptCheckpointError: the file was truncated, rewritten or replaced since it was opened (its reads
            may mix two files).
        """
        try:
            self._let_go(file)
            self._check_unchanged(file)
        finally:
            self._close(file)

    def _let_go(self, file: str) -> None:
        lease = self._leases.pop(file, None)
        if lease is not None:
            self._watch.finish(lease)
            if lease.writer_waited:
                self.preadv_reasons[file] = (
                    f"its read lease was broken after {lease.mapped_bytes} bytes had been read through a mapping (another "
                    "process opened the file for writing or truncated it); the rest was read with preadv"
                )

    def _check_unchanged(self, file: str) -> None:
        fd, opened = self._fds.get(file), self._identity.get(file)
        if fd is None or opened is None:
            return
        now = _identity(os.fstat(fd))
        try:
            named = _identity(os.stat(self.path(file)))
        except OSError:
            named = None
        if now != opened or named != opened:
            what = (
                "it was replaced (its path now names another file)" if named is not None and named[:2] != opened[:2] else
                "it was deleted" if named is None else
                f"its size went from {opened[2]} to {now[2]} bytes" if now[2] != opened[2] else
                "it was written to (its modification time changed)"
            )
            raise CorruptCheckpointError(
                f"{file} changed while it loaded: {what}. Its tensors may mix two files. "
                "Do not rewrite a checkpoint while it loads; load it again."
            )

    def _close(self, file: str) -> None:
        mm = self._maps.pop(file, None)
        if mm is not None and file not in self._kept:
            mm.close()  # nothing was made from it (torch.frombuffer holds no buffer export that would stop this)
        self._identity.pop(file, None)
        fd = self._fds.pop(file, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Release everything (a failed load too): leases given up, descriptors closed, nothing checked."""
        for file in list(self._leases):
            self._let_go(file)
        if self._watch is not None:
            self._watch.close()
        for file in list(self._fds):
            self._close(file)


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one that was opened, unchanged."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def release_pages(t: torch.Tensor) -> None:
    """Drop a mmapped CPU tensor's pages from this process's resident set (they stay in the page cache).

    Written by hand because torch offers no way to unmap part of a ``torch.load(mmap=True)`` mapping; the
    mapping is private and never written, so the kernel re-reads a dropped page from the file if touched again.
    """
    _advise(t.data_ptr(), t.numel() * t.element_size(), _MADV_DONTNEED)


def will_need_pages(start: int, length: int) -> None:
    """Ask the kernel to read in the pages of ``[start, start + length)`` of this process's memory (a file mapping) now."""
    _advise(start, length, _MADV_WILLNEED)


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


