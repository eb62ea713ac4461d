"""Cooperative Hub fetch: every checkpoint byte crosses the network once per job, in few large requests.

``fetch="ranges"`` under a process group. Per-rank exact ranges cost one HTTP request per row of a dim-1 slice
and every rank fetches the replicated tensors again; here the ranks fetch together instead:

The spans come from the Hub (``HttpRanges``) or from an object store (``objectstore.ObjectStoreRanges``).

1. Every rank's planned byte runs are all-gathered once (``all_gather_object``), tagged with the submodule
   that needs them. Every rank then computes the same schedule from the same data: the submodules, in plan
   order, grouped into waves of about ``wave_bytes`` (a larger submodule that every rank reads in ascending order,
   one tensor such as an embedding, is cut into several waves); in each wave, the union of all ranks' runs, per file,
   cut into spans of at most ``span_bytes``; each span owned by the rank with the fewest bytes so far.
2. Waves run in lockstep as the stream reaches their first submodule (``before_submodule``; read-ahead is off
   for this source, so a wave's buffers are dropped only once every read of the previous wave is done), and, in
   a submodule cut into several waves, as its reads reach the next one (``read``; one reader thread then). In a
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
the network works on wave k+1 while wave k is exchanged and read. Each buffer is a mapping of its own
(``pieces.wave_buffer``), given back to the system when its wave is dropped, not kept by malloc.
The process group's store carries the statuses because a store wait has a timeout and tells which key (rank)
is missing, where a gloo receive from a dead peer only fails, or hangs until the group's timeout. A rank whose
exchange fails posts that as its status of the next round (after the last wave, a closing round), so the
ranks that exchanged nothing with a dead peer and the ones that did all name it alike.

The parts: the schedule's arithmetic is ``schedule.py`` (pure), the bytes a rank holds of a wave and the messages
of its exchange ``pieces.py``, the status rounds ``wave_status.py``; this module runs the waves.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Mapping

import torch
import torch.distributed as dist

from ..errors import LowMemError, RankFailedError, RemoteFileChangedError
from ..settings import DEFAULT_SPAN_BYTES
from ..types import LoadPlan, RemoteFile
from . import ByteSource, ReadPolicy
from .http import HttpRanges
from .pieces import Pieces, lay_out_wave, wave_buffer
from .schedule import FETCH_THREADS, RankRuns, Span, default_wave_bytes, rank_runs, schedule_spans, wave_span_bytes
from .wave_status import WaveStatuses

__all__ = ["CooperativeRanges"]

DEFAULT_TIMEOUT_S = 30.0


class CooperativeRanges(ByteSource):
    """The byte source of a cooperative fetch (see the module doc): ``read(file, view, offset)`` from the wave."""

    # A wave's spans are dropped when the next wave starts: the stream must not run ahead. Reads are copies out of
    # memory: two threads. A rank holds only the bytes its runs cover: every read is one of its runs (no bands).
    policy = ReadPolicy(workers=2, read_ahead=False, band_reads=False)

    def __init__(
        self,
        remote: Mapping[str, RemoteFile],
        plan: LoadPlan,
        *,
        token=None, local: Mapping[str, str] | None = None,
        span_bytes: int = DEFAULT_SPAN_BYTES, wave_bytes: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
        synchronous: bool = False, ranges: ByteSource | None = None, runs: RankRuns | None = None,
    ):
        """``synchronous``: fetch this rank's spans on the calling thread (``HF_DEACTIVATE_ASYNC_LOAD=1``).
        ``ranges``: the source each span is fetched from (an object store's); default the Hub's ``HttpRanges``.
        ``runs``: this rank's byte runs where they are not the plan's tensor offsets (a DCP checkpoint's chunks)."""
        self._http = ranges if ranges is not None else HttpRanges(remote, token=token, local=local)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        runs = rank_runs(plan) if runs is None else runs
        gathered: list = [None] * self._world
        dist.all_gather_object(gathered, runs)
        span_bytes = wave_span_bytes(span_bytes, self._world)
        if wave_bytes is None:
            wave_bytes = default_wave_bytes(span_bytes, self._world)
        self._schedule = schedule_spans(gathered, span_bytes=span_bytes, wave_bytes=wave_bytes)
        self._wave_of, self._waves = self._schedule.wave_of, self._schedule.waves
        if self._schedule.cuts_submodules:
            # a submodule's reads advance its waves, each dropping the last: one reader, so no read is left behind
            self.policy = ReadPolicy(workers=1, read_ahead=False, band_reads=False)
        del gathered
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._next_wave = 0
        self._failed = False
        self._pool = None if synchronous else ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="lowmem-fetch")
        self._fetching: dict[int, tuple[dict, list]] = {}  # wave -> (buffers of this rank's spans, their requests)
        self._held: dict[str, Pieces] = {}  # file -> the bytes of the current wave this rank holds
        self._lock = threading.Lock()
        self._statuses = WaveStatuses(timeout_s=timeout_s)
        # what ``ranges`` fetched before the waves (a DCP checkpoint's chunk headers) counts too
        self.requests, self.bytes_fetched = self._http.requests, self._http.bytes_fetched
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
        done = 0
        while True:
            held = self._held.get(file)
            done += held.copy(view[done:], offset + done) if held is not None else 0
            if done == len(view):
                return
            # the rest comes in a later wave where a submodule is cut into several (``schedule_spans``); every read
            # before this one is done (one reader thread then), so the current wave can go
            wave = self._schedule.wave_at(self._rank, file, offset + done, since=self._next_wave)
            if wave is None:
                raise _not_held(file, offset + done, offset + len(view), self._next_wave - 1)
            while self._next_wave <= wave:
                self._run_next_wave()

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
        data = {id(s): wave_buffer(s.stop - s.start) for s in mine}
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

    def _exchange(self, index: int, data: dict[int, torch.Tensor]) -> dict[str, Pieces]:
        """Send each rank the pieces of this rank's spans it reads, receive this rank's pieces of the others'
        spans; return what this rank holds of the wave, per file."""
        held, receives, sends = lay_out_wave(self._schedule, index, self._rank, self._world, data)
        try:
            _transfer(receives, sends, self._group)
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


def _transfer(receives: list, sends: list, group) -> None:
    """Post every receive, then every send (so no pair of ranks waits on each other's receive); wait for all."""
    works = [dist.irecv(t, src=peer, group=group, tag=tag) for t, peer, tag in receives]
    works += [dist.isend(t, dst=peer, group=group, tag=tag) for t, peer, tag in sends]
    for work in works:
        work.wait()


def _not_held(file: str, start: int, stop: int, wave: int) -> LowMemError:
    # every rank's submodules come in one model order, so a read always falls in this wave or a later one
    return LowMemError(
        f"{file}: bytes {start}-{stop} are not in cooperative-fetch wave {wave} or a later one on this rank; the "
        "ranks' plans disagree on the submodules or their order (a lowmem_hf bug: please report it)."
    )


def _call_now(fn, *args) -> Future:
    """``fn(*args)`` on this thread, as a finished ``Future`` (its error is raised by ``result()``, as from a pool)."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as error:  # noqa: BLE001 - handed to the caller through the future, as a pool would
        future.set_exception(error)
    return future
