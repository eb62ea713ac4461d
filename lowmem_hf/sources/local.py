"""Local files: ``preadv`` into the reader's views, one descriptor per file, closed after the file's last read.

Also what only a local file offers: its path (for torch's own loader), a private mapping of it (``mmap=True``
leaves the tensors as views of it), read-ahead hints to the kernel, whether its pages are in the page cache
(``cached_fraction``), which decides how the stream reads (more threads and hints from a cold disk, reads
through gaps from a warm one).

Tensors are never converted straight from a mapping of the file during a load: a file cut while mapped kills the
process with SIGBUS, and on the machines measured (benchmarks/README.md) mapped windows, even under a kernel read
lease that rules the cut out, were slower than ``preadv`` into a staging chunk.

A file that changed while it was read is a named error: a read past its end says so, and when its last read is
done (``release``) its descriptor and its path must still name the same file, of the same size and modification
time, as when it was opened.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from typing import Mapping

import torch

from ..errors import CorruptCheckpointError
from ..types import file_identity
from . import ByteSource, ReadPolicy

__all__ = ["LocalFiles", "GAP_BYTES", "cached_fraction", "release_pages", "trim_heap", "will_need_pages"]

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
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
# Views smaller than this are not populated first (a dim-1 slice's rows, headers): one more syscall each would
# cost more than the faults it moves out of the copy.
_POPULATE_MIN_BYTES = 256 * 1024


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


def _open_as_planned(
    path: str, file: str, planned: tuple[int, int, int, int] | None
) -> tuple[int, tuple[int, int, int, int]]:
    """A descriptor of ``file`` (at ``path``) and the identity its reads are checked against (``planned``, else what
    was opened). Refused, closed, if it is no longer the ``planned`` file: its tensors' offsets come from that header."""
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger kernel read-ahead window
    opened = file_identity(os.fstat(fd))
    if planned is not None and opened != planned:
        os.close(fd)
        raise CorruptCheckpointError(
            f"{file} changed while it loaded: {_what_changed(planned, opened, opened)}, after its header "
            "was read. Its tensors' offsets and sizes come from that header. Do not rewrite a checkpoint "
            "while it loads; load it again."
        )
    return fd, planned or opened


def _preadv_runs(
    fd: int, parts: list[tuple[memoryview, int]], gap_bytes: int, scratch: memoryview | None, file: str
) -> int:
    """``LocalFiles.read_runs`` on ``fd``: runs at most ``gap_bytes`` apart share one ``preadv``, the bytes between
    them read into ``scratch`` (at least ``gap_bytes`` long). Returns how many bytes were so read and dropped."""
    i, dropped = 0, 0
    while i < len(parts):
        view, offset = parts[i]
        buffers, end, j, gaps = [view], offset + len(view), i + 1, 0
        while j < len(parts) and len(buffers) < _IOV_MAX - 1 and 0 <= parts[j][1] - end <= gap_bytes:
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
    return dropped


class LocalFiles(ByteSource):
    """Byte source over local files: ``preadv``, one descriptor per file, closed after the file's last tensor.

    Also what only a local file offers: its path (``path``), a private mapping of the file (``mapping``) that
    ``mmap=True`` leaves as the tensors, and read-ahead hints (``will_need``).
    """

    def __init__(
        self, paths: Mapping[str, str] | None = None, *, gap_bytes: int = 0,
        planned: Mapping[str, tuple[int, int, int, int]] | None = None,
    ):
        """``planned``: the identity (``types.file_identity``) each file had when its header was read; a file that
        is no longer that file when it is opened is refused (its tensors' offsets and sizes come from that header)."""
        self._paths = paths or {}
        self._planned = planned or {}
        self._gap = gap_bytes
        self.policy = ReadPolicy(gap_bytes=gap_bytes)
        self.gap_bytes_read = 0
        """Bytes read between runs and dropped (``read_runs``): page-cache copies, no device I/O."""
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
                    fd, self._identity[file] = _open_as_planned(self.path(file), file, self._planned.get(file))
                    self._fds[file] = fd
        return fd

    @classmethod
    def for_load(
        cls, paths: Mapping[str, str], *, cold: bool, planned: Mapping[str, tuple[int, int, int, int]] | None = None
    ) -> LocalFiles:
        """The files of a load, read as suits where their pages are: from the page cache (not ``cold``) runs up to
        ``GAP_BYTES`` apart share one read; from a cold disk none do, since a gap is bytes read from the device for
        nothing."""
        return cls(paths, gap_bytes=0 if cold else GAP_BYTES, planned=planned)

    def open(self, file: str) -> None:
        """Open ``file`` now, if it is not open yet (refused if it is no longer the file whose header was read)."""
        self._fd(file)

    def path(self, file: str) -> str:
        """Where ``file`` is on disk (Hub loads: the HF cache)."""
        return self._paths.get(file, file)

    def read(self, file: str, view: memoryview, offset: int) -> None:
        _pread_exact(self._fd(file), view, offset, file)

    def populate(self, views: list[memoryview]) -> None:
        """Fault in the whole pages of ``views`` in one ``madvise`` each (``_populate``): ``preadv`` into memory never
        touched takes each page's first fault inside the kernel's copy, which costs more."""
        for view in views:
            _populate(view)

    def read_runs(self, file: str, parts: list[tuple[memoryview, int]]) -> None:
        """Fill each ``(view, offset)`` of ``parts`` (ascending, non-overlapping offsets) from ``file``.

        Runs at most ``gap_bytes`` apart (the constructor's; 0: none) share one ``preadv``, the bytes between
        them read into a per-thread scratch buffer and dropped: a dim-1 slice is one run per row, and a syscall
        per row costs more than copying the other ranks' part of the row out of the page cache. Written by hand:
        nothing in the stack gathers file ranges.
        """
        self.count_gap(_preadv_runs(self._fd(file), parts, self._gap, self._scratch() if self._gap else None, file))

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
        """Every read of ``file`` is done: check it is still the file that was opened, close it.

        Raises:
            CorruptCheckpointError: the file was truncated, rewritten or replaced since it was opened (its reads
            may mix two files).
        """
        try:
            self.check_unchanged(file)
        finally:
            self._close(file)

    def check_unchanged(self, file: str) -> None:
        """Raise ``CorruptCheckpointError`` if ``file`` (open) was truncated, rewritten or replaced since it was opened."""
        fd, opened = self._fds.get(file), self._identity.get(file)
        if fd is None or opened is None:
            return
        now = file_identity(os.fstat(fd))
        try:
            named = file_identity(os.stat(self.path(file)))
        except OSError:
            named = None
        if now != opened or named != opened:
            raise CorruptCheckpointError(
                f"{file} changed while it loaded: {_what_changed(opened, now, named)}. Its tensors may mix two files. "
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
        """Release everything (a failed load too): descriptors closed, nothing checked."""
        for file in list(self._fds):
            self._close(file)


def _what_changed(was: tuple, now: tuple, named: tuple | None) -> str:
    """In words, how a file (``now``: its descriptor's identity; ``named``: its path's, None if gone) differs from ``was``."""
    if named is None:
        return "it was deleted"
    if named[:2] != was[:2]:
        return "it was replaced (its path now names another file)"
    if now[2] != was[2]:
        return f"its size went from {was[2]} to {now[2]} bytes"
    return "it was written to (its modification time changed)"


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


_populate_works: bool | None = None  # None: not asked yet; True: the kernel populated once; False: it cannot


def _populate(view: memoryview) -> None:
    """Fault in the whole pages of ``view`` (memory a ``preadv`` is about to fill) with one ``madvise``.

    A read into memory this process has not touched yet (a fresh parameter) takes each page's first fault inside
    the kernel's copy, one page at a time; ``MADV_POPULATE_WRITE`` takes them all in one call first. Measured on
    the 2 GB fp32 checkpoint loaded as fp32 (every tensor read straight into the model's memory), page-cache warm
    (``bench_usable.py --cases fp32_st_to_fp32``, benchmarks/README.md), it saves about 5% of the load in one process
    and about 8% at 2 TP ranks. A converted load populates each chunk's destination (fresh model memory, written by
    the converting ``copy_``) the same way: at every width of ``bench_shapes.py --against`` the load spends less
    CPU in page faults (benchmarks/README.md). Not for memory already touched (the staging buffers): there it only
    walks the pages again, and a converted load was 10% slower with it. Only pages wholly inside ``view`` are
    touched, and their contents are not changed. Neither torch nor Python offers it.
    Where the kernel has no ``MADV_POPULATE_WRITE`` (before 5.14), or not Linux, nothing is done.
    """
    global _populate_works
    if _populate_works is False or len(view) < _POPULATE_MIN_BYTES:
        return
    try:
        libc = _libc()
    except (OSError, TypeError, AttributeError):  # no C library by that name (Windows)
        _populate_works = False
        return
    try:
        start = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except TypeError:  # a read-only buffer: nothing to populate for writing
        return
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    end = (start + len(view)) // mmap.PAGESIZE * mmap.PAGESIZE
    if end <= first:
        return
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_POPULATE_WRITE) == 0:
        _populate_works = True
    elif _populate_works is None and ctypes.get_errno() == errno.EINVAL:
        _populate_works = False  # the first ask refused: this kernel has no MADV_POPULATE_WRITE, stop asking
    # Any other failure (memory the kernel will not populate, ENOMEM) leaves the faults to the copy: the hint only
    # saves time; memory the read cannot fill fails the preadv itself, with its own error.


def trim_heap() -> None:
    """Give back what the malloc arenas of finished threads hold free (the stream calls it when its readers end).

    glibc gives each thread that allocates its own arena and keeps what is freed there for the next allocation;
    the reader threads are gone once the stream ends, and nothing allocates from their arenas again. Measured
    here (2 ranks, 4 reader threads each, the 2 GB fp32 checkpoint as bf16): 4 MB per rank stayed resident until
    the process ended, which the first forward then added to its peak. ``malloc_trim(0)`` (glibc; ~0.5 ms)
    returns it. Neither torch nor Python offers this; elsewhere (no glibc) there is nothing to do.
    """
    try:
        trim = _libc().malloc_trim  # this process's own C library, as the local reads' madvise/mincore use it
    except (OSError, TypeError, AttributeError):  # not glibc (musl, macOS), or no C library by that name (Windows)
        return
    trim(0)


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


