"""Kernel read leases on local checkpoint files: while this process holds one, nobody can cut the file under a mapping.

Linux grants a read lease (``fcntl(fd, F_SETLEASE, F_RDLCK)``) only while no one has the file open for writing. Once
it is held, an ``open`` for writing or truncating and a ``truncate()`` of the file block until the holder gives the
lease up, or ``/proc/sys/fs/lease-break-time`` seconds pass; the holder is told at once (a signal, and
``F_GETLEASE`` answers ``F_UNLCK`` while the break is pending). So a read through a mapping of the file cannot meet a
page cut off (SIGBUS) as long as it ends before the lease is given up, which is what ``Lease`` guarantees: a mapped
read ``enter``s the lease and ``leave``s it after unmapping; once the lease is broken no read enters, and the lease is
given up by whoever sees the last mapped read leave. A break is noticed by the next read that tries to enter, and,
on a load with reader threads, at once by ``LeaseWatch``'s thread, which the kernel signals; mapped reads are a few
MiB each (``MAX_MAPPED_BYTES``), so the writer waits milliseconds, not the break time.

Written by hand: Python has ``fcntl`` but nothing in the stack takes leases. Refused (the caller reads with
``preadv`` and reports why): a writer has the file open (EAGAIN), a filesystem without leases (EINVAL, ENOLCK: NFS,
FUSE...), not the file's owner without ``CAP_LEASE`` (EACCES, EPERM), leases switched off, a break time under
``MIN_BREAK_SECONDS``, not Linux.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import threading
from dataclasses import dataclass

__all__ = ["Lease", "LeaseWatch", "MAX_MAPPED_BYTES", "MIN_BREAK_SECONDS"]

# The kernel sends this on a break instead of SIGIO, whose default action kills the process; SIGURG's default is to
# ignore it (it only ever means out-of-band data on a socket whose owner asked for it).
_BREAK_SIGNAL = getattr(signal, "SIGURG", None)
_F_SETOWN_EX, _F_OWNER_TID = 15, 0  # fcntl.h: direct the break signal to one thread (Python has no constant)
# Below this break time a slow mapped read could outlive the lease; such machines read with preadv.
MIN_BREAK_SECONDS = 5
# Largest read made through one mapping: copying it takes milliseconds, so a writer waits about that long.
MAX_MAPPED_BYTES = 64 << 20
# LeaseWatch: how often the lease of each file is looked at when no signal came (the signal can be lost in the
# instant between taking a lease and directing its signal to the watching thread).
_POLL_SECONDS = 0.05


def _break_seconds() -> int | None:
    try:
        with open("/proc/sys/fs/lease-break-time") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@dataclass
class Lease:
    """A read lease this process holds on ``file`` (descriptor ``fd``, opened read-only by the caller)."""

    file: str
    fd: int
    size: int
    """The file's size when the lease was taken: it cannot change while the lease is held."""
    inflight: int = 0
    """Mapped reads of the file under way."""
    broken: bool = False
    """No mapped read may start: the lease was broken (a writer waits) or the file is finished."""
    released: bool = False
    mapped_bytes: int = 0
    """Bytes read through mappings of the file under this lease."""
    writer_waited: bool = False
    """The lease was broken: another process opened the file for writing or truncated it."""

    def __post_init__(self):
        self._lock = threading.Lock()

    def enter(self) -> bool:
        """Start a mapped read; False: the lease is broken or given up, read with ``preadv``."""
        self.check()
        with self._lock:
            if self.broken:
                return False
            self.inflight += 1
            return True

    def leave(self, mapped: int) -> None:
        """A mapped read of ``mapped`` bytes ended and its mapping is gone; the last one out after a break gives the
        lease up."""
        with self._lock:
            self.inflight -= 1
            self.mapped_bytes += mapped
            self._release_if_idle()
        self.check()  # without a watching thread, a writer that came meanwhile would wait for the next read

    def check(self) -> None:
        """If a writer waits (the lease is broken), no mapped read starts any more, and the lease is given up as
        soon as none is under way."""
        if not self.broken and fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK:
            self.writer_waited = True
            self.stop()

    def stop(self) -> None:
        """No more mapped reads: give the lease up now, or when the last one under way leaves."""
        with self._lock:
            self.broken = True
            self._release_if_idle()

    def _release_if_idle(self) -> None:
        if self.broken and self.inflight == 0 and not self.released:
            self.released = True
            try:
                fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError:  # already gone (the break time passed, or the descriptor's last close): nothing held
                pass


class LeaseWatch:
    """Takes read leases and, with ``watch``, runs a thread that gives a broken one up as soon as the kernel signals
    the break (without it, the next mapped read of the file or the file's end does). ``close`` stops the thread.

    The thread blocks the break signal and waits for it (``sigtimedwait``); each lease's signal is directed to that
    thread alone (``F_SETOWN_EX``), so no other thread of the process ever sees it.
    """

    def __init__(self, *, watch: bool):
        self._watch = watch
        self._leases: list[Lease] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._tid: int | None = None
        self._started = threading.Event()
        self._stopping = False
        self.refusal = self._refusal()
        """Why no lease can be taken in this process at all (None: try per file)."""

    @staticmethod
    def _refusal() -> str | None:
        if not hasattr(fcntl, "F_SETLEASE") or _BREAK_SIGNAL is None:
            return "this platform has no kernel read leases (Linux only)"
        seconds = _break_seconds()
        if seconds is not None and seconds < MIN_BREAK_SECONDS:
            return (f"/proc/sys/fs/lease-break-time is {seconds} s, under the {MIN_BREAK_SECONDS} s a mapped read needs to be sure "
                    "to end before a writer may go ahead")
        if signal.getsignal(_BREAK_SIGNAL) not in (signal.SIG_DFL, signal.SIG_IGN):
            return f"this process handles {_BREAK_SIGNAL.name}, the signal a lease break would send"
        return None

    def take(self, file: str, fd: int) -> Lease | str:
        """A read lease on ``fd`` (``file`` opened read-only), or why none can be had (its errno, in words)."""
        if self.refusal is not None:
            return self.refusal
        try:
            fcntl.fcntl(fd, fcntl.F_SETSIG, _BREAK_SIGNAL)  # before the lease: a break must never send SIGIO
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            return _WHY.get(e.errno, f"the kernel refused a read lease ({errno.errorcode.get(e.errno, e.errno)}: {e.strerror})")
        lease = Lease(file, fd, os.fstat(fd).st_size)
        with self._lock:
            self._leases.append(lease)
        if self._watch:
            self._start()
            try:
                fcntl.fcntl(fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, self._tid))
            except OSError:  # the watching thread still polls this lease
                pass
        return lease

    def finish(self, lease: Lease) -> None:
        """``lease``'s file is done: no more mapped reads, the lease given up (every read has ended)."""
        lease.stop()
        with self._lock:
            if lease in self._leases:
                self._leases.remove(lease)

    def close(self) -> None:
        """Give every lease up and stop the thread."""
        with self._lock:
            leases, self._leases, self._stopping = self._leases, [], True
        for lease in leases:
            lease.stop()
        if self._thread is not None and self._thread.is_alive():
            signal.pthread_kill(self._thread.ident, _BREAK_SIGNAL)  # wakes it at once (it blocks the signal)
            self._thread.join()
        self._thread = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lowmem-lease", daemon=True)
            self._thread.start()
            self._started.wait()

    def _run(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {_BREAK_SIGNAL})
        self._tid = threading.get_native_id()
        self._started.set()
        while True:
            signal.sigtimedwait({_BREAK_SIGNAL}, _POLL_SECONDS)
            with self._lock:
                if self._stopping:
                    return
                leases = list(self._leases)
            for lease in leases:
                if not lease.broken:
                    lease.check()


_WHY = {
    errno.EAGAIN: "another process has the file open for writing (a read lease is granted only when no one has)",
    errno.EINVAL: "its filesystem does not support kernel read leases",
    errno.ENOLCK: "its filesystem does not support kernel read leases",
    errno.EACCES: "this process neither owns the file nor has CAP_LEASE",
    errno.EPERM: "this process neither owns the file nor has CAP_LEASE",
}
