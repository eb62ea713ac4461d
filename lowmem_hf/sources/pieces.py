"""The bytes one rank holds of a cooperative-fetch wave (``exchange.py``): its own spans whole, and the pieces of
the other ranks' spans that its runs cover, received packed; and which pieces go to and come from which rank.
"""

from __future__ import annotations

import bisect
import mmap

import numpy as np
import torch

from .schedule import Schedule

__all__ = ["Pieces", "pack", "lay_out_wave", "wave_buffer", "copy_runs", "hand_over_runs"]

Transfer = tuple[torch.Tensor, int, int]
"""``(bytes, peer, tag)`` of one point-to-point message: a span's index in its wave tags its pieces."""


def wave_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh memory for a wave (a span, a received piece, a packed copy), given back to the system
    the moment its last reference goes.

    From malloc, a wave's buffers (a few MiB each, freed and re-allocated every wave while the model's tensors are
    allocated between them) stayed resident after being freed: measured at 2 ranks (2 GB fp32 Llama as bf16, from
    the object store), RssAnon rose to 1.53x the rank's shard while the live wave buffers were 0.09x of it, and fell
    to 1.07x only when the load ended. A mapping of its own is unmapped on free (``MAP_POPULATE``: its pages are
    faulted in by one call, not one fault per page as the network writes them)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)


def lay_out_wave(
    schedule: Schedule, index: int, rank: int, world: int, data: dict[int, torch.Tensor]
) -> tuple[dict[str, Pieces], list[Transfer], list[Transfer]]:
    """``(held, receives, sends)`` of ``rank`` in wave ``index``: what it will hold per file (its spans, from
    ``data``: ``id(span)`` -> its bytes, and empty buffers for the pieces it receives; unsealed), and the messages.
    Only the parts of a span that a rank's runs cover go to it, one message per span and rank."""
    held: dict[str, Pieces] = {}
    receives: list[Transfer] = []
    sends: list[Transfer] = []
    for k, s in enumerate(schedule.waves[index]):
        if s.owner == rank:
            held.setdefault(s.file, Pieces()).add(np.array([s.start]), np.array([s.stop]), data[id(s)], packed=False)
            for peer in range(world):
                if peer != rank:
                    starts, stops = schedule.pieces(peer, index, s)
                    if len(starts):
                        sends.append((pack(data[id(s)], s.start, starts, stops), peer, k))
        else:
            starts, stops = schedule.pieces(rank, index, s)
            if len(starts):
                into = wave_buffer(int((stops - starts).sum()))
                held.setdefault(s.file, Pieces()).add(starts, stops, into, packed=True)
                receives.append((into, s.owner, k))
    return held, receives, sends


def pack(span_data: torch.Tensor, span_start: int, starts: np.ndarray, stops: np.ndarray) -> torch.Tensor:
    """The bytes ``[starts, stops)`` of a span, concatenated: a view of the span where they are one run, else a copy."""
    if len(starts) == 1:
        return span_data[int(starts[0]) - span_start : int(stops[0]) - span_start]
    src = span_data.numpy()
    out = wave_buffer(int((stops - starts).sum()))
    np.concatenate([src[a:b] for a, b in zip((starts - span_start).tolist(), (stops - span_start).tolist())], out=out.numpy())
    return out


class Pieces:
    """The bytes of one file this rank holds in a wave: its own spans whole, and the pieces received, as sorted
    ``[start, stop)`` runs, each at a position of a buffer."""

    def __init__(self):
        self._parts: list[tuple[np.ndarray, np.ndarray, int, np.ndarray]] = []  # (starts, stops, buffer, positions)
        self._buffers: list[memoryview] = []

    def add(self, starts: np.ndarray, stops: np.ndarray, data: torch.Tensor, *, packed: bool) -> None:
        """Runs ``[starts, stops)`` of the file held in ``data``: concatenated (``packed``), or ``data`` holds
        ``[starts[0], stops[-1])`` whole."""
        positions = np.concatenate(([0], np.cumsum(stops - starts)[:-1])) if packed else starts - starts[0]
        self._parts.append((starts, stops, len(self._buffers), positions))
        self._buffers.append(memoryview(data.numpy()))

    def seal(self) -> None:
        """Index the runs for ``copy`` (after the last ``add``)."""
        starts, stops, buffers, positions = (np.concatenate(x) for x in zip(*[
            (a, b, np.full(len(a), i), p) for a, b, i, p in self._parts
        ]))
        order = np.argsort(starts, kind="stable")
        self._starts, self._stops, self._buffer_of, self._positions = (
            x[order].tolist() for x in (starts, stops, buffers, positions)
        )

    def stream(self, offset: int, nbytes: int, consume) -> int:
        """Hand the bytes from ``offset`` to ``consume(piece, at)`` where they lie (views of the held buffers, ``at``
        counted from ``offset``), as far as they are held: the number of bytes handed over (as ``copy``)."""
        return self._walk(offset, nbytes, consume)

    def locate(self, offset: int, nbytes: int) -> tuple[memoryview, int] | None:
        """``(buffer, position)`` of bytes ``[offset, offset + nbytes)`` where one run holds them all, else None."""
        i = bisect.bisect_right(self._starts, offset) - 1
        if i < 0 or offset + nbytes > self._stops[i]:
            return None
        return self._buffers[self._buffer_of[i]], self._positions[i] + offset - self._starts[i]

    def copy(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` with the bytes from ``offset``, as far as they are held: the number of bytes filled (from
        the front; fewer than ``len(view)`` where a byte is not held, e.g. it comes in the next wave)."""

        def into(piece: memoryview, at: int) -> None:
            view[at : at + len(piece)] = piece

        return self._walk(offset, len(view), into)

    def _walk(self, offset: int, nbytes: int, consume) -> int:
        i = bisect.bisect_right(self._starts, offset) - 1
        done = 0
        while done < nbytes:
            pos = offset + done
            if i < 0 or i >= len(self._starts) or not self._starts[i] <= pos < self._stops[i]:
                return done
            take = min(nbytes - done, self._stops[i] - pos)
            at = self._positions[i] + pos - self._starts[i]
            consume(self._buffers[self._buffer_of[i]][at : at + take], done)
            done += take
            i += 1
        return done


def copy_runs(held, parts: list[tuple[memoryview, int]], read) -> None:
    """``ByteSource.read_runs`` over a wave: each ``(view, offset)`` held whole in ``held()`` (the current wave's
    ``Pieces`` of the file, or None) is copied from where it lies, the others go to ``read(view, offset)``, after
    which ``held()`` is asked again (the read may have run the next wave). A dim-1 slice is one run per row: a
    copy each, without a request's bookkeeping."""
    pieces = held()
    for view, offset in parts:
        where = pieces.locate(offset, len(view)) if pieces is not None else None
        if where is None:
            read(view, offset)
            pieces = held()
        else:
            view[:] = where[0][where[1] : where[1] + len(view)]


def hand_over_runs(held, runs: list[tuple[int, int]], consume, request) -> None:
    """``ByteSource.read_runs_streamed`` over a wave: runs held next to each other in one buffer of ``held()`` (a
    dim-1 slice's rows, received packed) go to ``consume(piece, at)`` as one piece, so a band of rows is converted
    by one call rather than one per row; the others go to ``request(offset, nbytes, at)``, after which ``held()`` is
    asked again. ``at`` counts over the runs' concatenation."""
    pieces, done, band = held(), 0, None  # band: [buffer, start, stop, at]
    for offset, nbytes in runs:
        where = pieces.locate(offset, nbytes) if pieces is not None else None
        if where is not None and band is not None and where[0] is band[0] and where[1] == band[2]:
            band[2] += nbytes
        else:
            if band is not None:
                consume(band[0][band[1] : band[2]], band[3])
                band = None
            if where is not None:
                band = [where[0], where[1], where[1] + nbytes, done]
            else:
                request(offset, nbytes, done)
                pieces = held()
        done += nbytes
    if band is not None:
        consume(band[0][band[1] : band[2]], band[3])
