"""Cooperative Hub fetch: every checkpoint byte crosses the network once per job, in few large requests.

``fetch="ranges"`` under a process group. Per-rank exact ranges cost one HTTP request per row of a dim-1 slice
and every rank fetches the replicated tensors again; here the ranks fetch together instead:

The bytes come from the Hub (``HttpRanges``) or from an object store (``objectstore.ObjectStoreRanges``).

1. Every rank's planned byte runs are all-gathered once (``all_gather_object``), tagged with the submodule
   that needs them. Every rank then computes the same schedule from the same data (``schedule_spans``):
   - a stretch of at least ``DIRECT_MIN_BYTES`` that only one rank reads (a dim-0 slice, an FSDP or ZeRO-3
     partition) is that rank's *direct* stretch: it requests those bytes itself when it reads them, straight into
     its tensor (or, converting from an object store, piece by piece as they arrive: ``read_streamed``). Nobody
     else wants them, so holding them in a span would only cost a buffer and a copy;
   - the rest (replicated tensors, dim-1 slices, the edges of row shards) goes in waves: the submodules, in plan
     order, grouped into waves of about ``wave_bytes`` of such bytes (a larger submodule that every rank reads in
     ascending order, one tensor such as a replicated embedding, is cut into several waves), the last waves
     smaller, since a rank holds a wave beside the model loaded so far, nearly all of it by then; in each wave,
     the union of all ranks' runs, per file, cut into spans of at most ``span_bytes``; each span owned by the rank
     with the fewest bytes so far, its direct bytes included.
2. Waves run in lockstep as the stream reaches their first submodule (``before_submodule``; the stream reads ahead
   only within the wave held, ``may_read_ahead``, so a wave's buffers are dropped only once every read of the
   previous wave is done), and, in a submodule cut into several waves, as its reads reach the next one (``read``;
   such a read first waits for every earlier read of the submodule, ``_InOrder``, so none is left behind). In a
   wave, each rank fetches its own spans, one Range request each (``HttpRanges``: resume on a cut, checks for a
   changed file); then the ranks post a status to the process group's store and wait for everyone's, with a timeout:
   a rank that died or failed is named on every rank, and a changed file raises ``RemoteFileChangedError``
   everywhere (a failed direct request is posted in the next round the same way). Then each span's owner sends every
   other rank only the bytes of the span that rank's runs cover (``Schedule.pieces``; point to point over gloo, one
   message per span and rank that needs any of it), and the readers copy (or convert) their bytes out of their own
   spans and the pieces they received. So a rank receives at most the bytes its plan reads that others read too; a
   broadcast of every span gave each rank the whole checkpoint, three times what it reads at tp 3.

Memory: the stream's readers (``DIRECT_READERS``: each has one request of a direct stretch in flight, read straight
into its tensor, or converted as it arrives, ``STREAM_PIECE_BYTES`` at a time), and of the waves: this rank's spans
of a wave and the pieces it receives (at most its share of the wave, ``wave_bytes``, default 64 MiB, larger only
where ``wave_span_bytes`` keeps spans at 4 MiB), the packed copies of pieces it sends while they are in flight (only
pieces made of several runs, e.g. a dim-1 slice's rows, are packed; one contiguous piece is sent from the span
itself), plus this rank's spans of the next wave, whose requests start once this wave is exchanged (the packed
copies gone): the network works on wave k+1 while wave k is read. Each buffer is a mapping of its own
(``pieces.wave_buffer``), given back to the system when its wave is dropped, not kept by malloc.
The process group's store carries the statuses because a store wait has a timeout and tells which key (rank)
is missing, where a gloo receive from a dead peer only fails, or hangs until the group's timeout. A rank whose
exchange fails posts that as its status of the next round (after the last wave, a closing round), so the
ranks that exchanged nothing with a dead peer and the ones that did all name it alike.

The parts: the schedule's arithmetic is ``schedule.py`` (pure), the bytes a rank holds of a wave and the messages
of its exchange ``pieces.py``, the status rounds ``wave_status.py``; this module runs the waves and the direct reads.
"""

from __future__ import annotations

import functools
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
from .pieces import Pieces, copy_runs, hand_over_runs, lay_out_wave, wave_buffer
from .schedule import (
    DIRECT_MIN_BYTES, DIRECT_READERS, FETCH_THREADS, RankRuns, Schedule, Span, default_wave_bytes, rank_runs, schedule_spans,
    wave_span_bytes,
)
from .wave_status import WaveStatuses

__all__ = ["CooperativeRanges"]

DEFAULT_TIMEOUT_S = 30.0


class CooperativeRanges(ByteSource):
    """The byte source of a cooperative fetch (see the module doc): ``read(file, view, offset)`` from the wave held
    (``_Waves``) or, for this rank's direct stretches, from the source."""

    # Reads are copies out of memory, or requests of this rank's direct stretches (one each): DIRECT_READERS
    # threads. A rank holds only the bytes its runs cover: every read is one of its runs (no bands).
    policy = ReadPolicy(workers=DIRECT_READERS, band_reads=False)

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
        self._rank, world = dist.get_rank(), dist.get_world_size()
        runs = rank_runs(plan) if runs is None else runs
        gathered: list = [None] * world
        dist.all_gather_object(gathered, runs)
        self._span_bytes = span_bytes = wave_span_bytes(span_bytes, world)
        if wave_bytes is None:
            wave_bytes = default_wave_bytes(span_bytes, world)
        self._schedule = schedule_spans(
            gathered, span_bytes=span_bytes, wave_bytes=wave_bytes, direct_bytes=min(span_bytes, DIRECT_MIN_BYTES),
        )
        del gathered
        self._lock = threading.Lock()
        # what ``ranges`` fetched before the waves (a DCP checkpoint's chunk headers) counts too
        self.requests, self.bytes_fetched = self._http.requests, self._http.bytes_fetched
        self.bytes_received = 0
        self._waves = _Waves(self._schedule, self._http, self._count, timeout_s=timeout_s, synchronous=synchronous)

    # -- the stream's hooks ------------------------------------------------------------------------------------

    def before_submodule(self, name: str) -> None:
        """Run every wave up to the one that holds ``name``'s bytes (all ranks reach the same waves in order)."""
        target = self._schedule.wave_of.get(name)
        if target is not None:
            with self._waves.advancing:
                self._waves.run_through(target)

    def may_read_ahead(self, name: str) -> bool:
        """Only into the wave held now. A later wave's ``before_submodule`` drops the one held, which earlier reads
        may still be reading; a cut submodule's reads run the waves themselves. Within a wave, the direct requests
        of the next submodules keep the readers busy while the stream finishes one."""
        held = self._waves.next - 1
        return name not in self._schedule.cut and self._schedule.wave_of.get(name, held) == held

    def arrange(self, name: str, jobs: list) -> list:
        """A submodule cut into several waves: its reads advance the waves, each dropping the last, so a read that
        must advance first waits for every earlier read of the submodule (``_InOrder``); the others never wait."""
        if name not in self._schedule.cut:
            return jobs
        order = _InOrder(len(jobs))
        return [functools.partial(order.run, i, job) for i, job in enumerate(jobs)]

    def read(self, file: str, view: memoryview, offset: int) -> None:
        self._serve(
            file, offset, len(view),
            held=lambda pieces, done: pieces.copy(view[done:], offset + done),
            direct=lambda done, stop: self._direct(lambda: self._http.read(file, view[done:stop], offset + done), stop - done),
        )

    def streams(self, file: str, offset: int, nbytes: int) -> bool:
        """Where the spans' source streams (S3): held bytes are handed over where they lie, direct ones as they arrive."""
        return self._http.streams(file, offset, nbytes)

    def read_streamed(self, file: str, offset: int, nbytes: int, consume) -> None:
        def direct(done: int, stop: int) -> None:
            def request() -> None:
                self._http.read_streamed(file, offset + done, stop - done, lambda piece, at: consume(piece, done + at))

            self._direct(request, stop - done)

        self._serve(
            file, offset, nbytes,
            held=lambda pieces, done: pieces.stream(offset + done, nbytes - done, lambda piece, at: consume(piece, done + at)),
            direct=direct,
        )

    def read_runs(self, file: str, parts: list[tuple[memoryview, int]]) -> None:
        copy_runs(lambda: self._waves.held.get(file), parts, lambda view, offset: self.read(file, view, offset))

    def read_runs_streamed(self, file: str, runs: list[tuple[int, int]], consume) -> None:
        def request(offset: int, nbytes: int, at: int) -> None:
            self.read_streamed(file, offset, nbytes, lambda piece, k: consume(piece, at + k))

        hand_over_runs(lambda: self._waves.held.get(file), runs, consume, request)

    def release(self, file: str) -> None:
        pass  # spans belong to waves, dropped when the next wave starts

    def close(self) -> None:
        try:
            self._waves.finish()
        finally:
            self._http.close()

    # -- serving a read ----------------------------------------------------------------------------------------

    def _serve(self, file: str, offset: int, nbytes: int, *, held, direct) -> None:
        """Bytes ``[offset, offset + nbytes)`` of ``file``, front to back: ``held(pieces, done)`` serves what the
        current wave holds from ``done`` on (returns how many it served), ``direct(done, stop)`` requests
        ``[done, stop)`` of a direct stretch of this rank; the rest comes in a later wave."""
        waves, done = self._waves, 0
        while True:
            seen = waves.next
            pieces = waves.held.get(file)
            done += held(pieces, done) if pieces is not None else 0
            if done == nbytes:
                return
            stop = self._schedule.direct_at(self._rank, file, offset + done)
            if stop is not None:  # only this rank reads these bytes: straight from the source
                take = min(nbytes, stop - offset, done + self._span_bytes)  # a request no larger than a span
                direct(done, take)
                done = take
                continue
            # the rest comes in a later wave where a submodule is cut into several (``schedule_spans``): once every
            # earlier read of the submodule is done, the current wave can go
            _InOrder.wait_for_earlier()
            with waves.advancing:
                if waves.next != seen:
                    continue  # an earlier read ran waves meanwhile: the one it brought may hold these bytes
                wave = self._schedule.wave_at(self._rank, file, offset + done, since=waves.next)
                if wave is None:
                    raise _not_held(file, offset + done, offset + nbytes, waves.next - 1)
                waves.run_through(wave)

    def _direct(self, request, nbytes: int) -> None:
        """One request for bytes of this rank's direct stretch; a failure becomes this rank's next status, so the
        ranks that read nothing of the file fail by name too (``close`` runs the rounds after a failed stream)."""
        try:
            request()
        except Exception as error:
            self._waves.fail_next_round(_status(error))
            raise
        self._count(requests=1, fetched=nbytes)

    def _count(self, *, requests: int = 0, fetched: int = 0, received: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_fetched += fetched
            self.bytes_received += received


class _Waves:
    """The lockstep waves of a cooperative fetch (the module doc's step 2): this rank's spans of each wave fetched
    from ``source``, a status round, then the exchange; ``held`` is what this rank holds of the current wave, per
    file. Whoever runs waves holds ``advancing``."""

    def __init__(self, schedule: Schedule, source: ByteSource, count, *, timeout_s: float, synchronous: bool):
        self._schedule, self._source, self._count = schedule, source, count
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._statuses = WaveStatuses(timeout_s=timeout_s)
        self._pool = None if synchronous else ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="lowmem-fetch")
        self._fetching: dict[int, tuple[dict, list]] = {}  # wave -> (buffers of this rank's spans, their requests)
        self._failed = False
        self._failure: str | None = None  # a direct read's failure, posted as this rank's next status
        self._lock = threading.Lock()
        self.advancing = threading.Lock()  # one thread at a time runs waves
        self.next = 0
        """The next wave to run."""
        self.held: dict[str, Pieces] = {}

    def run_through(self, wave: int) -> None:
        """Run every wave up to ``wave`` (the caller holds ``advancing``)."""
        while self.next <= wave:
            try:
                self._run_wave(self.next)
            except BaseException:
                self._failed = True  # the other ranks know (or will time out naming this one): no more waves
                raise
            self.next += 1

    def fail_next_round(self, status: str) -> None:
        """This rank failed a request of its own: post ``status`` in the next round, so every rank raises it."""
        with self._lock:
            self._failure = self._failure or status

    def finish(self) -> None:
        """Take part in the waves this rank needs nothing from, so every rank runs every wave; then the closing
        round of statuses, where a rank whose last exchange or direct request failed says so."""
        try:
            with self.advancing:
                if not self._failed:
                    self.run_through(len(self._schedule.waves) - 1)
                if not self._failed:
                    self._statuses.agree(len(self._schedule.waves), self._failure or "ok", what="the closing round")
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            self.held, self._fetching = {}, {}

    def _start_fetch(self, index: int) -> None:
        """Submit this rank's span requests of wave ``index`` (into buffers of their own)."""
        mine = [s for s in self._schedule.waves[index] if s.owner == self._rank]
        data = {id(s): wave_buffer(s.stop - s.start) for s in mine}
        submit = self._pool.submit if self._pool is not None else _call_now
        self._fetching[index] = (data, [submit(self._fetch, s, data[id(s)]) for s in mine])

    def _run_wave(self, index: int) -> None:
        self.held = {}  # every read of the previous wave has finished (read-ahead stays within a wave)
        if index not in self._fetching:
            if self._failure is None:
                self._start_fetch(index)
            else:  # this round only tells the others; nothing of the wave is needed
                self._fetching[index] = ({}, [])
        data, futures = self._fetching.pop(index)
        status = "ok"
        try:
            for future in futures:
                future.result()
        except Exception as error:  # noqa: BLE001 - reported to every rank below, then raised here too
            status = _status(error)
        if self._failure is not None:  # a direct read failed since the last round: every rank learns it here
            status = self._failure
        self._statuses.agree(index, status)
        self.held = self._exchange(index, data)
        if index + 1 < len(self._schedule.waves):
            # the network works on the next wave while this one is read; started once the exchange's packed copies
            # are gone, so they and the next wave's spans are never held at once
            self._start_fetch(index + 1)

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
        self._count(received=sum(t.numel() for t, _, _ in receives))
        for pieces in held.values():
            pieces.seal()
        return held

    def _fetch(self, span: Span, into: torch.Tensor) -> None:
        self._source.read(span.file, memoryview(into.numpy()), span.start)
        self._count(requests=1, fetched=span.stop - span.start)


def _transfer(receives: list, sends: list, group) -> None:
    """Post every receive, then every send (so no pair of ranks waits on each other's receive); wait for all."""
    works = [dist.irecv(t, src=peer, group=group, tag=tag) for t, peer, tag in receives]
    works += [dist.isend(t, dst=peer, group=group, tag=tag) for t, peer, tag in sends]
    for work in works:
        work.wait()


class _InOrder:
    """The reads of one cut submodule, numbered in plan order (ascending bytes). The stream's pool starts them in
    that order (a FIFO queue), so when read ``i`` runs, every earlier one has started; ``wait_for_earlier`` lets it
    wait until they have all finished (none of them waits on a later one: no deadlock). Reads that need no new wave
    (held bytes, direct stretches) run in parallel as in any submodule."""

    _current = threading.local()

    def __init__(self, n: int):
        self._done = [False] * n
        self._first_open = 0  # every read before this one has finished
        self._changed = threading.Condition()

    def run(self, i: int, job) -> None:
        _InOrder._current.ticket = (self, i)
        try:
            job()
        finally:
            _InOrder._current.ticket = None
            with self._changed:
                self._done[i] = True
                while self._first_open < len(self._done) and self._done[self._first_open]:
                    self._first_open += 1
                self._changed.notify_all()

    @staticmethod
    def wait_for_earlier() -> None:
        """On a read's thread: wait until every earlier read of its cut submodule has finished (no-op elsewhere)."""
        ticket = getattr(_InOrder._current, "ticket", None)
        if ticket is not None:
            order, i = ticket
            with order._changed:
                order._changed.wait_for(lambda: order._first_open >= i)


def _status(error: Exception) -> str:
    """A failed request as a rank posts it (``wave_status``): a changed file is ``RemoteFileChangedError`` everywhere."""
    if isinstance(error, RemoteFileChangedError):
        return "changed:" + str(error)
    return f"error:{type(error).__name__}: {error}"


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
