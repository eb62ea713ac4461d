"""The stream's counters, which the readers and their staging fill while it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["StreamStats"]


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
