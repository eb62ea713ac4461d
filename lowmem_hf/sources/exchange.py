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
   ``RemoteFileChangedError`` everywhere. Then each span is broadcast from its owner (gloo on CPU), and the
   readers copy their bytes out of the wave's spans.

Memory: one wave of spans beyond the model (``wave_bytes``, default 64 MiB, at least two spans per rank), plus
this rank's spans of the next wave, whose requests start as soon as this wave's are done: the network works on
wave k+1 while wave k is exchanged and read.
The process group's store carries the statuses because a store wait has a timeout and tells which key (rank)
is missing, where a gloo collective with a dead peer only fails, or hangs until the group's timeout.
"""

from __future__ import annotations

import bisect
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from ..errors import LowMemError, RankFailedError, RemoteFileChangedError
from ..plan.sharding import element_runs
from ..types import LoadPlan, RemoteFile
from . import ByteSource
from .http import HttpRanges

__all__ = ["CooperativeRanges", "schedule_spans", "DEFAULT_SPAN_BYTES", "DEFAULT_WAVE_BYTES"]

DEFAULT_SPAN_BYTES = 16 * 1024 * 1024
DEFAULT_WAVE_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0
_FETCH_THREADS = 4  # concurrent span requests per rank: a span is one request, so this hides latency


@dataclass(frozen=True)
class Span:
    """``[start, stop)`` of ``file``, fetched by ``owner`` with one request and broadcast to every rank."""

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


class CooperativeRanges(ByteSource):
    """The byte source of a cooperative fetch (see the module doc): ``read(file, view, offset)`` from the wave."""

    read_ahead = False  # a wave's spans are dropped when the next wave starts: the stream must not run ahead
    workers = 2  # reads are copies out of memory
    band_reads = True  # a read is a lookup among the wave's spans: one per band of rows, not one per row

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
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._next_wave = 0
        self._failed = False
        self._pool = None if synchronous else ThreadPoolExecutor(max_workers=_FETCH_THREADS, thread_name_prefix="lowmem-fetch")
        self._fetching: dict[int, tuple[dict, list]] = {}  # wave -> (buffers of this rank's spans, their requests)
        self._buffers: dict[str, tuple[list[int], list[tuple[Span, torch.Tensor]]]] = {}
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
        starts, spans = self._buffers.get(file, ((), ()))
        i = bisect.bisect_right(starts, offset) - 1
        done = 0
        while done < len(view):
            span, data = spans[i] if 0 <= i < len(spans) else (None, None)
            at = offset + done - span.start if span is not None else -1
            if span is None or not 0 <= at < span.stop - span.start:
                # every rank's submodules come in one model order, so a read always falls in the current wave
                raise LowMemError(
                    f"{file}: bytes at {offset + done} are not in cooperative-fetch wave {self._next_wave - 1}; the "
                    "ranks' plans disagree on the submodule order (a lowmem_hf bug: please report it)."
                )
            take = min(len(view) - done, span.stop - span.start - at)
            view[done : done + take] = memoryview(data.numpy())[at : at + take]
            done += take
            i += 1

    def release(self, file: str) -> None:
        pass  # spans belong to waves, dropped when the next wave starts

    def close(self) -> None:
        """Take part in the waves this rank needs nothing from, so every rank runs every wave."""
        try:
            while not self._failed and self._next_wave < len(self._waves):
                self._run_next_wave()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self._buffers, self._fetching = {}, {}
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
        self._buffers = {}  # every read of the previous wave has finished (no read-ahead)
        spans = self._waves[index]
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
        data.update((id(s), torch.empty(s.stop - s.start, dtype=torch.uint8)) for s in spans if id(s) not in data)
        for s in spans:
            try:
                dist.broadcast(data[id(s)], src=s.owner, group=self._group)
            except RuntimeError as error:
                # gloo says only that a connection broke; the live ranks all land here, so a roll call names the dead
                dead = self._statuses.roll_call(f"{index}/broadcast")
                raise RankFailedError(
                    f"cooperative fetch, wave {index}: the exchange of {s.file} bytes {s.start}-{s.stop} failed "
                    f"({error}); rank(s) {dead or '[unknown]'} died or stopped answering. The load is aborted on every rank."
                ) from error
            if s.owner != self._rank:
                self.bytes_received += s.stop - s.start
        by_file: dict[str, list[tuple[Span, torch.Tensor]]] = {}
        for s in spans:
            by_file.setdefault(s.file, []).append((s, data[id(s)]))
        self._buffers = {f: ([s.start for s, _ in pairs], pairs) for f, pairs in by_file.items()}

    def _fetch(self, span: Span, into: torch.Tensor) -> None:
        self._http.read(span.file, memoryview(into.numpy()), span.start)
        with self._lock:
            self.requests += 1
            self.bytes_fetched += span.stop - span.start


class WaveStatuses:
    """Each rank's status per wave, posted to the process group's store (see the module doc: a store wait has a
    timeout and names the missing rank, where a gloo collective with a dead peer fails or hangs)."""

    def __init__(self, *, timeout_s: float):
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._store = dist.distributed_c10d._get_default_store()
        self._timeout_s = timeout_s
        tag = [f"lowmem_hf/exchange/{time.time_ns()}"]
        dist.broadcast_object_list(tag, src=0)
        self._tag = tag[0]  # this load's store keys, unique per load

    def roll_call(self, what: str) -> list[int]:
        """Ranks that do not check in under ``what`` within the timeout (a dead rank never does)."""
        key = f"{self._tag}/alive/{what}/"
        self._store.set(key + str(self._rank), "1")
        try:
            self._store.wait([key + str(r) for r in range(self._world)], timedelta(seconds=self._timeout_s))
            return []
        except Exception:  # noqa: BLE001 - a timeout is the answer
            return [r for r in range(self._world) if not self._store.check([key + str(r)])]

    def agree(self, index: int, status: str) -> None:
        """Post this rank's status for the wave and wait for every rank's; fail everywhere if one failed."""
        key = f"{self._tag}/{index}/"
        self._store.set(key + str(self._rank), status)
        keys = [key + str(r) for r in range(self._world)]
        try:
            self._store.wait(keys, timedelta(seconds=self._timeout_s))
        except Exception as error:  # noqa: BLE001 - the store raises a bare RuntimeError/DistStoreError on timeout
            missing = [r for r in range(self._world) if not self._store.check([key + str(r)])]
            raise RankFailedError(
                f"cooperative fetch, wave {index}: rank(s) {missing} posted no status within {self._timeout_s:.0f} s "
                f"(died or hung); the load is aborted on every rank. ({error})"
            ) from error
        statuses = {r: self._store.get(key + str(r)).decode() for r in range(self._world)}
        failed = {r: s for r, s in statuses.items() if s != "ok"}
        if not failed:
            return
        rank, why = min(failed.items())
        if why.startswith("changed:"):
            raise RemoteFileChangedError(f"rank {rank}: {why.removeprefix('changed:')}")
        raise RankFailedError(f"cooperative fetch, wave {index}: rank {rank} failed: {why.removeprefix('error:')}")


def _call_now(fn, *args) -> Future:
    """``fn(*args)`` on this thread, as a finished ``Future`` (its error is raised by ``result()``, as from a pool)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as error:  # noqa: BLE001 - handed to the caller through the future, as a pool would
        future.set_exception(error)
    return future
