"""Cooperative Hub fetch: every checkpoint byte crosses the network once per job, in few large requests.

``fetch="ranges"`` under a process group. Per-rank exact ranges cost one HTTP request per row of a dim-1 slice
and every rank fetches the replicated tensors again; here the ranks fetch together instead:

1. Every rank's planned byte runs are all-gathered once (``all_gather_object``), tagged with the submodule
   that needs them. Every rank then computes the same schedule from the same data: the submodules, in plan
   order, grouped into waves of about ``wave_bytes``; in each wave, the union of all ranks' runs, per file,
   cut into spans of at most ``span_bytes``; each span owned by the rank with the fewest bytes so far.
2. Waves run in lockstep as the stream reaches their first submodule (``before_submodule``; read-ahead is off
   for this source, so a wave's buffers are dropped only once every read of the previous wave is done). In a
   wave, each rank fetches its own spans, one Range request each (``HttpRanges``: resume on a cut, checks for a
   changed file); then the ranks post a status to the process group's store and wait for everyone's, with a
   timeout: a rank that died or failed is named on every rank, and a changed file raises
   ``RemoteFileChangedError`` everywhere. Then each span's owner sends every other rank only the bytes of the
   span that rank's runs cover (``span_pieces``; point to point over gloo, one message per span and rank that
   needs any of it), and the readers copy their bytes out of their own spans and the pieces they received. So
   a rank receives at most the bytes its plan reads, less those in its own spans; a broadcast of every span
   gave each rank the whole checkpoint, three times what it reads at tp 3.

Memory: this rank's spans of a wave and the pieces it receives (at most its share of the wave, ``wave_bytes``,
default 64 MiB, at least two spans per rank), the packed copies of pieces it sends while they are in flight
(only pieces made of several runs, e.g. a dim-1 slice's rows, are packed; one contiguous piece is sent from the
span itself), plus this rank's spans of the next wave, whose requests start as soon as this wave's are done:
the network works on wave k+1 while wave k is exchanged and read.
The process group's store carries the statuses because a store wait has a timeout and tells which key (rank)
is missing, where a gloo receive from a dead peer only fails, or hangs until the group's timeout. A rank whose
exchange fails posts that as its status of the next round (after the last wave, a closing round), so the
ranks that exchanged nothing with a dead peer and the ones that did all name it alike.
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from ..errors import LowMemError, RankFailedError, RemoteFileChangedError
from ..plan.sharding import element_runs
from ..types import LoadPlan, RemoteFile
from . import ByteSource
from .http import HttpRanges

__all__ = ["CooperativeRanges", "schedule_spans", "span_pieces", "DEFAULT_SPAN_BYTES", "DEFAULT_WAVE_BYTES"]

DEFAULT_SPAN_BYTES = 16 * 1024 * 1024
DEFAULT_WAVE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0
_FETCH_THREADS = 4  # concurrent span requests per rank: a span is one request, so this hides latency


@dataclass(frozen=True)
class Span:
    """``[start, stop)`` of ``file``, fetched by ``owner`` with one request; the other ranks get the parts they need."""

    file: str
    start: int
    stop: int
    owner: int


def _runs(plan: LoadPlan) -> list[tuple[str, str, int, int]]:
    """This rank's byte runs ``(submodule, file, start, stop)``, in plan order."""
    out = []
    for sub in plan.submodules:
        infos = [(r.source, r.shard) for r in sub.reads] + [(i, None) for c in sub.conversions for _, i in c.sources]
        for info, shard in infos:
            size = info.dtype.itemsize
            out += [(sub.name, info.file, info.offset + a * size, info.offset + (a + n) * size) for a, n in element_runs(info.shape, shard)]
    return out


def _union(runs: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """Merged ``(file, start, stop)`` intervals covering ``runs`` (touching intervals merge)."""
    merged: list[list] = []
    for file, start, stop in sorted(runs):
        if merged and merged[-1][0] == file and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], stop)
        else:
            merged.append([file, start, stop])
    return [tuple(m) for m in merged]


def schedule_spans(
    runs_by_rank: list[list[tuple[str, str, int, int]]], *, span_bytes: int, wave_bytes: int
) -> tuple[dict[str, int], list[list[Span]]]:
    """The cooperative schedule every rank computes alike from everyone's runs (a pure function).

    Returns ``{submodule: wave index}`` and, per wave, its spans with owners. Submodules keep the order in
    which they first appear (plan order, the same on every rank); a wave closes once it holds ``wave_bytes``.
    """
    order: dict[str, list] = {}
    for runs in runs_by_rank:
        for sub, file, start, stop in runs:
            order.setdefault(sub, []).append((file, start, stop))
    wave_of, waves, current, size = {}, [], [], 0
    for sub, runs in order.items():
        wave_of[sub] = len(waves)
        current += runs
        size += sum(b - a for _, a, b in _union(runs))
        if size >= wave_bytes:
            waves.append(current)
            current, size = [], 0
    if current:
        waves.append(current)
    owned = [0] * len(runs_by_rank)
    spans_per_wave = []
    for wave in waves:
        spans = []
        for file, start, stop in _union(wave):
            for a in range(start, stop, span_bytes):
                owner = min(range(len(owned)), key=lambda r: (owned[r], r))
                b = min(stop, a + span_bytes)
                owned[owner] += b - a
                spans.append(Span(file, a, b, owner))
        spans_per_wave.append(spans)
    return wave_of, spans_per_wave


def wave_needs(
    runs_by_rank: list[list[tuple[str, str, int, int]]], wave_of: Mapping[str, int], waves: int
) -> list[list[list[tuple[str, int, int]]]]:
    """``[wave][rank]``: the merged ``(file, start, stop)`` intervals that rank reads in that wave (a pure function)."""
    needs: list[list[list]] = [[[] for _ in runs_by_rank] for _ in range(waves)]
    for rank, runs in enumerate(runs_by_rank):
        for sub, file, start, stop in runs:
            needs[wave_of[sub]][rank].append((file, start, stop))
    return [[_union(runs) for runs in wave] for wave in needs]


def span_pieces(need: list[tuple[str, int, int]], spans: list[Span]) -> list[list[tuple[int, int]]]:
    """Per span, the ``[start, stop)`` parts of it that ``need`` covers, ascending (a pure function).

    ``need`` is merged and sorted by ``(file, start)`` (``_union``); ``spans`` are sorted alike, as a wave's
    are. A span's pieces for a rank are what its owner sends that rank, concatenated, in this order.
    """
    out: list[list[tuple[int, int]]] = [[] for _ in spans]
    first = 0
    for k, span in enumerate(spans):
        while first < len(need) and (need[first][0], need[first][2]) <= (span.file, span.start):
            first += 1  # ends before this span (and, spans being sorted, before every later one)
        i = first
        while i < len(need) and (need[i][0], need[i][1]) < (span.file, span.stop):
            file, start, stop = need[i]
            if file == span.file and max(start, span.start) < min(stop, span.stop):
                out[k].append((max(start, span.start), min(stop, span.stop)))
            i += 1
    return out


class CooperativeRanges(ByteSource):
    """The byte source of a cooperative fetch (see the module doc): ``read(file, view, offset)`` from the wave."""

    read_ahead = False  # a wave's spans are dropped when the next wave starts: the stream must not run ahead
    workers = 2  # reads are copies out of memory
    # A rank holds only the bytes its runs cover, not the other ranks' parts of a row: every read must be one of
    # its runs (a read is a copy out of memory, so one per row costs no request, unlike HttpRanges' bands).
    band_reads = False

    def __init__(
        self,
        remote: Mapping[str, RemoteFile],
        plan: LoadPlan,
        *,
        token=None,
        local: Mapping[str, str] | None = None,
        span_bytes: int = DEFAULT_SPAN_BYTES,
        wave_bytes: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        synchronous: bool = False,
    ):
        """``synchronous``: fetch this rank's spans on the calling thread (``HF_DEACTIVATE_ASYNC_LOAD=1``)."""
        self._http = HttpRanges(remote, token=token, local=local)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        runs = _runs(plan)
        gathered: list = [None] * self._world
        dist.all_gather_object(gathered, runs)
        wave_bytes = wave_bytes if wave_bytes is not None else max(DEFAULT_WAVE_BYTES, 2 * self._world * span_bytes)
        self._wave_of, self._waves = schedule_spans(gathered, span_bytes=span_bytes, wave_bytes=wave_bytes)
        self._needs = wave_needs(gathered, self._wave_of, len(self._waves))
        del gathered
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._next_wave = 0
        self._failed = False
        self._pool = None if synchronous else ThreadPoolExecutor(max_workers=_FETCH_THREADS, thread_name_prefix="lowmem-fetch")
        self._fetching: dict[int, tuple[dict, list]] = {}  # wave -> (buffers of this rank's spans, their requests)
        self._held: dict[str, _Pieces] = {}  # file -> the bytes of the current wave this rank holds
        self._lock = threading.Lock()
        self._statuses = WaveStatuses(timeout_s=timeout_s)
        self.requests = 0
        self.bytes_fetched = 0
        self.bytes_received = 0

    # -- the stream's hooks ------------------------------------------------------------------------------------

    def before_submodule(self, name: str) -> None:
        """Run every wave up to the one that holds ``name``'s bytes (all ranks reach the same waves in order)."""
        target = self._wave_of.get(name)
        if target is None:
            return
        while self._next_wave <= target:
            self._run_next_wave()

    def read(self, file: str, view: memoryview, offset: int) -> None:
        held = self._held.get(file)
        if held is None or not held.copy(view, offset):
            # every rank's submodules come in one model order, so a read always falls in the current wave
            raise LowMemError(
                f"{file}: bytes {offset}-{offset + len(view)} are not in cooperative-fetch wave {self._next_wave - 1} "
                "on this rank; the ranks' plans disagree on the submodules or their order (a lowmem_hf bug: please "
                "report it)."
            )

    def release(self, file: str) -> None:
        pass  # spans belong to waves, dropped when the next wave starts

    def close(self) -> None:
        """Take part in the waves this rank needs nothing from, so every rank runs every wave; then the closing
        round of statuses, where a rank whose last exchange failed says so."""
        try:
            while not self._failed and self._next_wave < len(self._waves):
                self._run_next_wave()
            if not self._failed:
                self._statuses.agree(len(self._waves), "ok", what="the closing round")
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._held, self._fetching = {}, {}
            self._http.close()

    # -- one wave ----------------------------------------------------------------------------------------------

    def _run_next_wave(self) -> None:
        try:
            self._run_wave(self._next_wave)
        except BaseException:
            self._failed = True  # the other ranks know (or will time out naming this one): no more waves
            raise
        self._next_wave += 1

    def _start_fetch(self, index: int) -> None:
        """Submit this rank's span requests of wave ``index`` (into buffers of their own)."""
        mine = [s for s in self._waves[index] if s.owner == self._rank]
        data = {id(s): torch.empty(s.stop - s.start, dtype=torch.uint8) for s in mine}
        submit = self._pool.submit if self._pool is not None else _call_now
        self._fetching[index] = (data, [submit(self._fetch, s, data[id(s)]) for s in mine])

    def _run_wave(self, index: int) -> None:
        self._held = {}  # every read of the previous wave has finished (no read-ahead)
        if index not in self._fetching:
            self._start_fetch(index)
        data, futures = self._fetching.pop(index)
        status = "ok"
        try:
            for future in futures:
                future.result()
        except RemoteFileChangedError as error:
            status = "changed:" + str(error)
        except Exception as error:  # noqa: BLE001 - reported to every rank below, then raised here too
            status = f"error:{type(error).__name__}: {error}"
        if status == "ok" and index + 1 < len(self._waves):
            self._start_fetch(index + 1)  # the network works on the next wave while this one is exchanged and read
        self._statuses.agree(index, status)
        self._held = self._exchange(index, data)

    def _exchange(self, index: int, data: dict[int, torch.Tensor]) -> dict[str, _Pieces]:
        """Send each rank the pieces of this rank's spans it reads, receive this rank's pieces of the others'
        spans; return what this rank holds of the wave, per file."""
        spans, needs = self._waves[index], self._needs[index]
        self._needs[index] = None  # this wave's schedule is used up
        held: dict[str, _Pieces] = {}
        for s in spans:
            if s.owner == self._rank:
                held.setdefault(s.file, _Pieces()).add(s.start, [(s.start, s.stop)], data[id(s)])
        receives, sends = [], []  # (tensor, peer, tag); a span's index in the wave tags its pieces
        for rank in range(self._world):
            pieces = span_pieces(needs[rank], spans)
            for k, s in enumerate(spans):
                if not pieces[k] or (rank == self._rank) == (s.owner == self._rank):
                    continue  # nothing of it needed, or an own span (held whole), or a span between two others
                if rank == self._rank:
                    into = torch.empty(sum(b - a for a, b in pieces[k]), dtype=torch.uint8)
                    held.setdefault(s.file, _Pieces()).add(s.start, pieces[k], into, packed=True)
                    receives.append((into, s.owner, k))
                else:
                    sends.append((_pack(data[id(s)], s.start, pieces[k]), rank, k))
        works = []
        try:
            # every receive is posted before any send, so no pair of ranks can wait on each other's receive
            works += [(dist.irecv(t, src=peer, group=self._group, tag=tag), peer) for t, peer, tag in receives]
            works += [(dist.isend(t, dst=peer, group=self._group, tag=tag), peer) for t, peer, tag in sends]
            for work, _ in works:
                work.wait()
        except RuntimeError as error:
            # gloo says only that a connection broke, and only to the ranks that exchanged with the dead one: the
            # next round of statuses (every live rank reaches it) names the missing rank everywhere
            peers = sorted({peer for _, peer, _ in receives + sends})
            failed = self._statuses.report_failure(index + 1, f"exchange of wave {index} with rank(s) {peers} failed: {error}")
            raise RankFailedError(
                f"cooperative fetch, wave {index}: the exchange with rank(s) {peers} failed ({error}); rank(s) "
                f"{failed or '[unknown]'} died or stopped answering. The load is aborted on every rank."
            ) from error
        self.bytes_received += sum(t.numel() for t, _, _ in receives)
        for pieces in held.values():
            pieces.seal()
        return held

    def _fetch(self, span: Span, into: torch.Tensor) -> None:
        self._http.read(span.file, memoryview(into.numpy()), span.start)
        with self._lock:
            self.requests += 1
            self.bytes_fetched += span.stop - span.start


def _pack(span_data: torch.Tensor, span_start: int, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """The bytes of ``pieces`` of a span, concatenated: a view of the span where they are one run, else a copy."""
    if len(pieces) == 1:
        a, b = pieces[0]
        return span_data[a - span_start : b - span_start]
    src = span_data.numpy()
    out = np.empty(sum(b - a for a, b in pieces), dtype=np.uint8)
    np.concatenate([src[a - span_start : b - span_start] for a, b in pieces], out=out)
    return torch.from_numpy(out)


class _Pieces:
    """The bytes of one file this rank holds in a wave: its own spans whole, and the pieces received, as sorted
    ``[start, stop)`` runs, each at a position of a buffer."""

    def __init__(self):
        self._runs: list[tuple[int, int, memoryview, int]] = []  # (start, stop, buffer, position of start in it)
        self._starts: list[int] = []

    def add(self, base: int, pieces: list[tuple[int, int]], data: torch.Tensor, *, packed: bool = False) -> None:
        """``pieces`` of the file in ``data``: concatenated (``packed``), or at their offset from ``base``."""
        buffer, at = memoryview(data.numpy()), 0
        for a, b in pieces:
            self._runs.append((a, b, buffer, at if packed else a - base))
            at += b - a

    def seal(self) -> None:
        self._runs.sort(key=lambda run: run[0])
        self._starts = [run[0] for run in self._runs]

    def copy(self, view: memoryview, offset: int) -> bool:
        """Fill ``view`` with the bytes from ``offset``; False if some of them are not held."""
        i = bisect.bisect_right(self._starts, offset) - 1
        done, runs = 0, self._runs
        while done < len(view):
            if i < 0 or i >= len(runs):
                return False
            start, stop, buffer, at = runs[i]
            pos = offset + done
            if not start <= pos < stop:
                return False
            take = min(len(view) - done, stop - pos)
            view[done : done + take] = buffer[at + pos - start : at + pos - start + take]
            done += take
            i += 1
        return True


class WaveStatuses:
    """Each rank's status per round (one per wave, then a closing one), posted to the process group's store (see
    the module doc: a store wait has a timeout and names the missing rank, where a gloo receive from a dead peer
    fails or hangs)."""

    def __init__(self, *, timeout_s: float):
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._store = dist.distributed_c10d._get_default_store()
        self._timeout_s = timeout_s
        tag = [f"lowmem_hf/exchange/{time.time_ns()}"]
        dist.broadcast_object_list(tag, src=0)
        self._tag = tag[0]  # this load's store keys, unique per load

    def report_failure(self, index: int, why: str) -> list[int]:
        """Post ``why`` as this rank's status of round ``index`` (the round the live ranks reach next) and return
        the ranks that post none within the timeout (a dead or hung rank never does)."""
        key = f"{self._tag}/{index}/"
        self._store.set(key + str(self._rank), "error:" + why)
        try:
            self._store.wait([key + str(r) for r in range(self._world)], timedelta(seconds=self._timeout_s))
            return []
        except Exception:  # noqa: BLE001 - a timeout is the answer
            return [r for r in range(self._world) if not self._store.check([key + str(r)])]

    def agree(self, index: int, status: str, *, what: str | None = None) -> None:
        """Post this rank's status of round ``index`` (``what``: its name in errors, default ``wave <index>``) and
        wait for every rank's; fail everywhere if one failed."""
        what = what or f"wave {index}"
        key = f"{self._tag}/{index}/"
        self._store.set(key + str(self._rank), status)
        keys = [key + str(r) for r in range(self._world)]
        try:
            self._store.wait(keys, timedelta(seconds=self._timeout_s))
        except Exception as error:  # noqa: BLE001 - the store raises a bare RuntimeError/DistStoreError on timeout
            missing = [r for r in range(self._world) if not self._store.check([key + str(r)])]
            raise RankFailedError(
                f"cooperative fetch, {what}: rank(s) {missing} posted no status within {self._timeout_s:.0f} s "
                f"(died or hung); the load is aborted on every rank. ({error})"
            ) from error
        statuses = {r: self._store.get(key + str(r)).decode() for r in range(self._world)}
        failed = {r: s for r, s in statuses.items() if s != "ok"}
        if not failed:
            return
        rank, why = min(failed.items())
        if why.startswith("changed:"):
            raise RemoteFileChangedError(f"rank {rank}: {why.removeprefix('changed:')}")
        raise RankFailedError(f"cooperative fetch, {what}: rank {rank} failed: {why.removeprefix('error:')}")


def _call_now(fn, *args) -> Future:
    """``fn(*args)`` on this thread, as a finished ``Future`` (its error is raised by ``result()``, as from a pool)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as error:  # noqa: BLE001 - handed to the caller through the future, as a pool would
        future.set_exception(error)
    return future
