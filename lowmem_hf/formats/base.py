"""What every format's reader shares: the contract with the stream, its counters, staging buffers, byte views."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..types import ShardSpec, TensorInfo

__all__ = ["Reader", "StreamStats", "Staging", "byte_view"]


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

    def read(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        if self.on_read is not None:
            self.on_read(nbytes)

    def opened(self, path: str) -> None:
        if path not in self.files_read:
            self.files_read.append(path)

    def staged(self, nbytes: int) -> None:
        self.staging_bytes = max(self.staging_bytes, nbytes)


class Reader:
    """The contract between a format's reader and the stream (``stream.stream`` drives it).

    ``jobs`` returns independent reads that together fill a destination (already of the decided dtype and
    device) with the stored tensor or this rank's slice of it, converting on the fly; the stream runs them on
    its threads, then calls ``done``. ``close`` comes last, once every job has finished. Nothing of a file stays
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

    def close(self) -> None:
        """Release what the reader holds (every job has finished)."""


class Staging:
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


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (for ``preadv``)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
