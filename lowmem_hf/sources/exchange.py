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
   span that rank's runs cover (``Schedule.pieces``; point to point over gloo, one message per span and rank that
   needs any of it), and the readers copy their bytes out of their own spans and the pieces they received. So
   a rank receives at most the bytes its plan reads, less those in its own spans; a broadcast of every span
   gave each rank the whole checkpoint, three times what it reads at tp 3.

Memory: this rank's spans of a wave and the pieces it receives (at most its share of the wave, ``wave_bytes``,
default 64 MiB, larger only where ``wave_span_bytes`` keeps spans at 4 MiB), the packed copies of pieces it
sends while they are in flight (only pieces made of several runs, e.g. a dim-1 slice's rows, are packed; one
contiguous piece is sent from the span itself), plus this rank's spans of the next wave, whose requests start as soon as this wave's are done:
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
from typing import Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist

from ..compat.torch_api import default_store
from ..distributed.group import Failure, failure_error, from_rank_zero
from ..errors import LowMemError, RankFailedError, RemoteFileChangedError
from ..runs import element_runs
from ..settings import DEFAULT_SPAN_BYTES
from ..types import LoadPlan, RemoteFile
from . import ByteSource, ReadPolicy
from .http import HttpRanges

__all__ = ["CooperativeRanges", "schedule_spans", "Schedule", "RankRuns", "DEFAULT_SPAN_BYTES", "DEFAULT_WAVE_BYTES"]

DEFAULT_WAVE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0
_FETCH_THREADS = 4  # concurrent span requests per rank: a span is one request, so this hides latency
_MIN_SPAN_BYTES = 4 * 1024 * 1024  # below this a span's request latency weighs more than its transfer


@dataclass(frozen=True)
class Span:
    """``[start, stop)`` of ``file``, fetched by ``owner`` with one request; the other ranks get the parts they need."""

    file: str
    start: int
    stop: int
    owner: int


@dataclass(frozen=True, eq=False)
class RankRuns:
    """One rank's planned byte runs, as one table: a dim-1 slice is one run per row, tens of thousands per rank
    on a small model, and as Python tuples gathering and scheduling them took seconds."""

    submodules: tuple[str, ...]
    """The submodules that read anything, in plan order."""
    files: tuple[str, ...]
    """The files read, in order of first use."""
    table: np.ndarray
    """int64 ``[n, 4]``: submodule index, file index, start, stop (bytes of the file), in plan order."""

    @classmethod
    def from_tuples(cls, runs: Iterable[tuple[str, str, int, int]]) -> RankRuns:
        """From ``(submodule, file, start, stop)`` runs in plan order (for tests and small plans)."""
        subs: dict[str, int] = {}
        files: dict[str, int] = {}
        rows = [(subs.setdefault(sub, len(subs)), files.setdefault(file, len(files)), a, b) for sub, file, a, b in runs]
        return cls(tuple(subs), tuple(files), np.array(rows, dtype=np.int64).reshape(-1, 4))


def _runs(plan: LoadPlan) -> RankRuns:
    """This rank's byte runs, in plan order."""
    subs: list[str] = []
    files: dict[str, int] = {}
    blocks = []
    for sub in plan.submodules:
        infos = [(r.source, r.shard) for r in sub.reads] + [(i, None) for c in sub.conversions for _, i in c.sources]
        before = len(blocks)
        for info, shard in infos:
            runs = element_runs(info.shape, shard)
            if not runs:
                continue
            elements = np.array(runs, dtype=np.int64).reshape(-1, 2)
            block = np.empty((len(elements), 4), dtype=np.int64)
            block[:, 0] = len(subs)
            block[:, 1] = files.setdefault(info.file, len(files))
            block[:, 2] = info.offset + elements[:, 0] * info.dtype.itemsize
            block[:, 3] = block[:, 2] + elements[:, 1] * info.dtype.itemsize
            blocks.append(block)
        if len(blocks) > before:
            subs.append(sub.name)
    table = np.concatenate(blocks) if blocks else np.empty((0, 4), dtype=np.int64)
    return RankRuns(tuple(subs), tuple(files), table)


def _merge(keys: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per key, the union of the ``[start, stop)`` intervals (touching ones merge), sorted by ``(key, start)``."""
    if len(keys) == 0:
        return keys, starts, stops
    order = np.lexsort((starts, keys))
    keys, starts, stops = keys[order], starts[order], stops[order]
    group = np.concatenate(([0], np.cumsum(keys[1:] != keys[:-1])))
    # the furthest stop so far within the key: offsetting each key's stops past every earlier key's lets one
    # running maximum serve all keys (offsets stay far below 2**63: groups < 2**22, files < 2**40 bytes)
    reach = np.maximum.accumulate(stops + (group << 40))
    new = np.ones(len(keys), dtype=bool)
    new[1:] = (group[1:] != group[:-1]) | (starts[1:] + (group[1:] << 40) > reach[:-1])
    first = np.flatnonzero(new)
    return keys[first], starts[first], np.maximum.reduceat(stops, first)


@dataclass(frozen=True)
class Schedule:
    """The cooperative schedule, the same on every rank (``schedule_spans``)."""

    wave_of: dict[str, int]
    """The wave of each submodule that reads anything."""
    waves: list[list[Span]]
    """Per wave, its spans (sorted by file, then offset), with owners."""
    needs: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per rank, the bytes it reads: ``(keys, starts, stops)``, merged and sorted, key ``wave * files + file``."""
    file_index: dict[str, int]
    """Each file's number in the keys of ``needs``."""

    def pieces(self, rank: int, wave: int, span: Span) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: the parts of ``span`` (of ``wave``) that ``rank`` reads, ascending; what the span's
        owner sends that rank, concatenated in this order."""
        keys, starts, stops = self.needs[rank]
        key = wave * len(self.file_index) + self.file_index[span.file]
        lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        first = lo + np.searchsorted(stops[lo:hi], span.start, "right")
        last = lo + np.searchsorted(starts[lo:hi], span.stop, "left")
        return np.maximum(starts[first:last], span.start), np.minimum(stops[first:last], span.stop)


def schedule_spans(runs_by_rank: list[RankRuns], *, span_bytes: int, wave_bytes: int) -> Schedule:
    """The cooperative schedule every rank computes alike from everyone's runs (a pure function).

    Submodules keep the order in which they first appear (plan order, the same on every rank); a wave closes once
    it holds ``wave_bytes``. A wave's bytes are the union of every rank's runs in it, cut into spans of at most
    ``span_bytes``, each owned by the rank with the fewest bytes so far.
    """
    files = sorted({f for runs in runs_by_rank for f in runs.files})
    file_index = {f: i for i, f in enumerate(files)}
    subs: dict[str, int] = {}
    for runs in runs_by_rank:
        for name in runs.submodules:
            subs.setdefault(name, len(subs))
    tables = []  # per rank, global numbers: (submodule, file, start, stop)
    for runs in runs_by_rank:
        sub_map = np.array([subs[n] for n in runs.submodules] or [0], dtype=np.int64)
        file_map = np.array([file_index[f] for f in runs.files] or [0], dtype=np.int64)
        t = runs.table
        tables.append((sub_map[t[:, 0]], file_map[t[:, 1]], t[:, 2], t[:, 3]))
    sub, file, start, stop = (np.concatenate([t[i] for t in tables]) for i in range(4))
    n_files = max(1, len(files))
    keys, a, b = _merge(sub * n_files + file, start, stop)
    size_of = np.bincount(keys // n_files, weights=b - a, minlength=len(subs))  # bytes of each submodule's union
    wave_of_sub, wave, size = np.zeros(len(subs), dtype=np.int64), 0, 0
    for i in range(len(subs)):
        wave_of_sub[i] = wave
        size += int(size_of[i])
        if size >= wave_bytes and i + 1 < len(subs):
            wave, size = wave + 1, 0
    waves: list[list[Span]] = [[] for _ in range(wave + 1 if len(subs) else 0)]
    owned = [0] * len(runs_by_rank)
    for key, lo, hi in zip(*(x.tolist() for x in _merge(wave_of_sub[sub] * n_files + file, start, stop))):
        for at in range(lo, hi, span_bytes):
            owner = min(range(len(owned)), key=lambda r: (owned[r], r))
            end = min(hi, at + span_bytes)
            owned[owner] += end - at
            waves[key // n_files].append(Span(files[key % n_files], at, end, owner))
    needs = [_merge(wave_of_sub[s] * n_files + f, a_, b_) for s, f, a_, b_ in tables]
    wave_of = {name: int(wave_of_sub[i]) for name, i in subs.items()}
    return Schedule(wave_of=wave_of, waves=waves, needs=needs, file_index=file_index)


def wave_span_bytes(span_bytes: int, world: int) -> int:
    """The span size: at most ``span_bytes``, and small enough that each rank owns ``_FETCH_THREADS`` spans of a
    default wave, down to ``_MIN_SPAN_BYTES`` (the wave grows instead). A span is one connection, and a connection's
    rate is capped (a CDN's per-connection throughput, the benchmark's throttle): with 16 MiB spans, 3 ranks owned
    two spans of each 96 MiB wave and left half their fetch threads idle."""
    return min(span_bytes, max(_MIN_SPAN_BYTES, DEFAULT_WAVE_BYTES // (world * _FETCH_THREADS)))


class CooperativeRanges(ByteSource):
    """The byte source of a cooperative fetch (see the module doc): ``read(file, view, offset)`` from the wave."""

    # A wave's spans are dropped when the next wave starts: the stream must not run ahead. Reads are copies out of
    # memory: two threads. A rank holds only the bytes its runs cover, not the other ranks' parts of a row: every
    # read must be one of its runs (one per row costs no request, unlike HttpRanges' bands).
    policy = ReadPolicy(workers=2, read_ahead=False, band_reads=False)

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
        span_bytes = wave_span_bytes(span_bytes, self._world)
        if wave_bytes is None:
            wave_bytes = max(DEFAULT_WAVE_BYTES, self._world * _FETCH_THREADS * span_bytes)
        self._schedule = schedule_spans(gathered, span_bytes=span_bytes, wave_bytes=wave_bytes)
        self._wave_of, self._waves = self._schedule.wave_of, self._schedule.waves
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
        held: dict[str, _Pieces] = {}
        receives, sends = [], []  # (tensor, peer, tag); a span's index in the wave tags its pieces
        for k, s in enumerate(self._waves[index]):
            if s.owner == self._rank:
                held.setdefault(s.file, _Pieces()).add(np.array([s.start]), np.array([s.stop]), data[id(s)], packed=False)
                for rank in range(self._world):
                    if rank != self._rank:
                        starts, stops = self._schedule.pieces(rank, index, s)
                        if len(starts):
                            sends.append((_pack(data[id(s)], s.start, starts, stops), rank, k))
            else:
                starts, stops = self._schedule.pieces(self._rank, index, s)
                if len(starts):
                    into = torch.empty(int((stops - starts).sum()), dtype=torch.uint8)
                    held.setdefault(s.file, _Pieces()).add(starts, stops, into, packed=True)
                    receives.append((into, s.owner, k))
        works = []
        try:
            # every receive is posted before any send, so no pair of ranks can wait on each other's receive
            works += [dist.irecv(t, src=peer, group=self._group, tag=tag) for t, peer, tag in receives]
            works += [dist.isend(t, dst=peer, group=self._group, tag=tag) for t, peer, tag in sends]
            for work in works:
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


def _pack(span_data: torch.Tensor, span_start: int, starts: np.ndarray, stops: np.ndarray) -> torch.Tensor:
    """The bytes ``[starts, stops)`` of a span, concatenated: a view of the span where they are one run, else a copy."""
    if len(starts) == 1:
        return span_data[int(starts[0]) - span_start : int(stops[0]) - span_start]
    src = span_data.numpy()
    out = np.empty(int((stops - starts).sum()), dtype=np.uint8)
    np.concatenate([src[a:b] for a, b in zip((starts - span_start).tolist(), (stops - span_start).tolist())], out=out)
    return torch.from_numpy(out)


class _Pieces:
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

    def copy(self, view: memoryview, offset: int) -> bool:
        """Fill ``view`` with the bytes from ``offset``; False if some of them are not held."""
        i = bisect.bisect_right(self._starts, offset) - 1
        done = 0
        while done < len(view):
            pos = offset + done
            if i < 0 or i >= len(self._starts) or not self._starts[i] <= pos < self._stops[i]:
                return False
            take = min(len(view) - done, self._stops[i] - pos)
            at = self._positions[i] + pos - self._starts[i]
            view[done : done + take] = self._buffers[self._buffer_of[i]][at : at + take]
            done += take
            i += 1
        return True


class WaveStatuses:
    """Each rank's status per round (one per wave, then a closing one), posted to the process group's store (see
    the module doc: a store wait has a timeout and names the missing rank, where a gloo receive from a dead peer
    fails or hangs). So not ``group.agree``, whose ``all_gather_object`` has neither; the error every rank raises
    for the statuses is the one ``agree`` would raise (``group.failure_error``)."""

    def __init__(self, *, timeout_s: float):
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._store = default_store()
        self._timeout_s = timeout_s
        # this load's store keys, unique per load: rank 0's clock
        self._tag = from_rank_zero(f"lowmem_hf/exchange/{time.time_ns()}", dist.group.WORLD)

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
        failed = [(r, _failure(s)) for r, s in sorted(statuses.items()) if s != "ok"]
        if failed:
            raise failure_error(failed, context=f"cooperative fetch, {what}")


def _failure(status: str) -> Failure:
    """The ``Failure`` a rank's posted status stands for: a changed file is ``RemoteFileChangedError`` on every rank."""
    if status.startswith("changed:"):
        return Failure(status.removeprefix("changed:"), error=RemoteFileChangedError)
    return Failure(status.removeprefix("error:"))


def _call_now(fn, *args) -> Future:
    """``fn(*args)`` on this thread, as a finished ``Future`` (its error is raised by ``result()``, as from a pool)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as error:  # noqa: BLE001 - handed to the caller through the future, as a pool would
        future.set_exception(error)
    return future
