"""The cooperative fetch's schedule (``exchange.py``), pure arithmetic on every rank's planned byte runs.

Every rank computes the same ``Schedule`` from the same gathered runs: the submodules in plan order, grouped into
waves; each wave's union of runs cut into spans, each owned by one rank; and for each rank and span, the parts of
the span that rank reads. No I/O and no process group here, so the arithmetic is tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..runs import element_runs
from ..types import LoadPlan

__all__ = [
    "Span", "RankRuns", "Schedule", "rank_runs", "collect_runs", "schedule_spans", "wave_span_bytes", "default_wave_bytes",
    "DEFAULT_WAVE_BYTES", "FETCH_THREADS", "DIRECT_MIN_BYTES", "DIRECT_READERS",
]

DEFAULT_WAVE_BYTES = 64 * 1024 * 1024
FETCH_THREADS = 4  # concurrent span requests per rank: a span is one request, so this hides latency
_MIN_SPAN_BYTES = 4 * 1024 * 1024  # below this a span's request latency weighs more than its transfer
_TAIL_SHARE = 2
_MIN_TAIL_WAVE_BYTES = 8 * 1024 * 1024
DIRECT_MIN_BYTES = 1024 * 1024
"""The shortest stretch only one rank reads that it fetches itself rather than through a span (``schedule_spans``)."""
DIRECT_READERS = 8
"""Reader threads of a cooperative fetch: each has one request of a direct stretch in flight. From an object store
the bodies are converted as they arrive, so a reader stages 256 KiB, not a chunk; at 2-3 ranks (probe_s3_memory.py)
8 readers loaded in 6.1-6.6 s where 4 took 6.9-7.0 s and 2 took 8.5-9.6 s, for 0.01x more memory than 4."""


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


def rank_runs(plan: LoadPlan) -> RankRuns:
    """This rank's byte runs, in plan order."""
    return collect_runs(
        (sub.name, [
            (info.file, info.offset, element_runs(info.shape, shard), info.dtype.itemsize)
            for info, shard in [(r.source, r.shard) for r in sub.reads] + [(i, None) for c in sub.conversions for _, i in c.sources]
        ])
        for sub in plan.submodules
    )


def collect_runs(submodules: Iterable[tuple[str, Iterable[tuple[str, int, Sequence[tuple[int, int]], int]]]]) -> RankRuns:
    """A ``RankRuns`` from, per submodule in plan order, its reads: ``(file, offset, runs, itemsize)``, where
    ``runs`` are ``(first element, elements)`` of a stored tensor whose element 0 is at byte ``offset`` of
    ``file``. Submodules that read nothing are left out."""
    subs: list[str] = []
    files: dict[str, int] = {}
    blocks = []
    for name, reads in submodules:
        before = len(blocks)
        for file, offset, runs, itemsize in reads:
            if not len(runs):
                continue
            elements = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
            block = np.empty((len(elements), 4), dtype=np.int64)
            block[:, 0] = len(subs)
            block[:, 1] = files.setdefault(file, len(files))
            block[:, 2] = offset + elements[:, 0] * itemsize
            block[:, 3] = block[:, 2] + elements[:, 1] * itemsize
            blocks.append(block)
        if len(blocks) > before:
            subs.append(name)
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
    direct: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = ()
    """Per rank, the stretches only it reads, each long enough to be fetched on its own: ``(files, starts, stops)``,
    merged, sorted by file then start. Their rank fetches them straight into its reads; they are in no wave."""
    cut: frozenset[str] = frozenset()
    """The submodules whose bytes come in several waves (their reads advance the waves)."""

    def direct_at(self, rank: int, file: str, offset: int) -> int | None:
        """The end of ``rank``'s direct stretch of ``file`` that holds byte ``offset``; None: no direct stretch holds it."""
        if not self.direct:
            return None
        files, starts, stops = self.direct[rank]
        at = self.file_index.get(file)
        if at is None:
            return None
        lo, hi = np.searchsorted(files, at, "left"), np.searchsorted(files, at, "right")
        i = lo + np.searchsorted(starts[lo:hi], offset, "right") - 1
        return int(stops[i]) if lo <= i < hi and offset < stops[i] else None

    def wave_at(self, rank: int, file: str, offset: int, *, since: int = 0) -> int | None:
        """The first wave from ``since`` on in which ``rank`` reads byte ``offset`` of ``file`` (None: none)."""
        keys, starts, stops = self.needs[rank]
        n_files, at = len(self.file_index), self.file_index.get(file)
        if at is None:
            return None
        hit = np.flatnonzero((keys % n_files == at) & (keys // n_files >= since) & (starts <= offset) & (offset < stops))
        return int(keys[hit[0]] // n_files) if len(hit) else None

    def pieces(self, rank: int, wave: int, span: Span) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)``: the parts of ``span`` (of ``wave``) that ``rank`` reads, ascending; what the span's
        owner sends that rank, concatenated in this order."""
        keys, starts, stops = self.needs[rank]
        key = wave * len(self.file_index) + self.file_index[span.file]
        lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
        first = lo + np.searchsorted(stops[lo:hi], span.start, "right")
        last = lo + np.searchsorted(starts[lo:hi], span.stop, "left")
        return np.maximum(starts[first:last], span.start), np.minimum(stops[first:last], span.stop)


def schedule_spans(runs_by_rank: list[RankRuns], *, span_bytes: int, wave_bytes: int, direct_bytes: int | None = None) -> Schedule:
    """The cooperative schedule every rank computes alike from everyone's runs (a pure function).

    Submodules keep the order in which they first appear (plan order, the same on every rank); a wave closes once
    it holds ``wave_bytes``, or toward the end half of the bytes still to come, down to 8 MiB (``_wave_budget``).
    A submodule larger than ``wave_bytes`` that every rank reads in ascending byte order (one tensor: an embedding,
    an output head) is cut into several such waves: a rank then holds a wave of it, not all of it (``exchange.py``
    advances the waves as its reads reach them). A wave's bytes are the union of every rank's runs in it, cut into
    spans of at most ``span_bytes``, each owned by the rank with the fewest bytes so far.

    With ``direct_bytes``, a stretch of a file that only one rank reads (in the whole job) and that is at least
    ``direct_bytes`` long (a dim-0 slice, a ZeRO-3 or FSDP partition) is in no span: that rank fetches it straight
    into its reads (``Schedule.direct``), and only the bytes several ranks read (replicated tensors, dim-1 slices,
    the edges of row shards) make the waves, are cut into spans and exchanged. A span would cost the rank a buffer
    of its own and a copy for bytes nobody else wants; the owner's direct bytes count as owned when the spans are
    shared out.
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
    direct: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    if direct_bytes is not None:
        direct = _read_by_one_rank([_merge(t[1], t[2], t[3]) for t in tables], direct_bytes)
        tables = [_without(t, d) for t, d in zip(tables, direct)]
    sub, file, start, stop = (np.concatenate([t[i] for t in tables]) for i in range(4))
    n_files = max(1, len(files))
    first_wave, cuts, n_waves = _cut_waves(sub, file, start, stop, len(subs), n_files, wave_bytes, _ascending(tables))
    waved = [_wave_runs(t, first_wave, cuts) for t in tables]  # per rank: (wave, file, start, stop)
    wave, file, start, stop = (np.concatenate([t[i] for t in waved]) for i in range(4))
    waves: list[list[Span]] = [[] for _ in range(n_waves)]
    owned = [int((d[2] - d[1]).sum()) for d in direct] or [0] * len(runs_by_rank)
    for key, lo, hi in zip(*(x.tolist() for x in _merge(wave * n_files + file, start, stop))):
        for at in range(lo, hi, span_bytes):
            owner = min(range(len(owned)), key=lambda r: (owned[r], r))
            end = min(hi, at + span_bytes)
            owned[owner] += end - at
            waves[key // n_files].append(Span(files[key % n_files], at, end, owner))
    needs = [_merge(w * n_files + f, a_, b_) for w, f, a_, b_ in waved]
    wave_of = {name: int(first_wave[i]) for name, i in subs.items()}
    cut = frozenset(name for name, i in subs.items() if len(cuts.get(i, ())))
    return Schedule(wave_of=wave_of, waves=waves, needs=needs, file_index=file_index, direct=direct, cut=cut)


def _read_by_one_rank(needs: list[tuple[np.ndarray, np.ndarray, np.ndarray]], min_bytes: int) -> list[tuple[np.ndarray, ...]]:
    """Per rank, ``(files, starts, stops)``: the stretches of at least ``min_bytes`` that it alone reads, from every
    rank's runs merged per file (``needs``). A sweep: +1 (and +rank) where a run starts, -1 where it ends; where the
    count is 1, the running sum of ranks is the one reading there. Shorter stretches (a dim-1 slice's part of a row)
    stay in the spans: one request each would cost more than the exchange."""
    keys = np.concatenate([n[0] for n in needs] * 2)
    at = np.concatenate([n[1] for n in needs] + [n[2] for n in needs])
    ranks = np.concatenate([np.full(len(n[0]), r, dtype=np.int64) for r, n in enumerate(needs)])
    ones = np.ones(len(ranks), dtype=np.int64)
    order = np.lexsort((at, keys))
    keys, at = keys[order], at[order]
    count = np.cumsum(np.concatenate([ones, -ones])[order])  # each key's events sum to 0: one running sum serves all
    rank = np.cumsum(np.concatenate([ranks, -ranks])[order])
    alone = (keys[1:] == keys[:-1]) & (at[1:] > at[:-1]) & (count[:-1] == 1)
    seg_keys, seg_starts, seg_stops, seg_rank = keys[:-1][alone], at[:-1][alone], at[1:][alone], rank[:-1][alone]
    n_ranks = len(needs)
    merged_keys, merged_starts, merged_stops = _merge(seg_keys * n_ranks + seg_rank, seg_starts, seg_stops)
    long = merged_stops - merged_starts >= min_bytes
    merged_keys, merged_starts, merged_stops = merged_keys[long], merged_starts[long], merged_stops[long]
    return [
        (merged_keys[mine] // n_ranks, merged_starts[mine], merged_stops[mine])
        for mine in (merged_keys % n_ranks == r for r in range(n_ranks))
    ]


def _without(table: tuple[np.ndarray, ...], direct: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, ...]:
    """One rank's runs ``(sub, file, start, stop)`` less its ``direct`` stretches (merged, sorted by file and start):
    a run inside one is dropped, one across an edge is trimmed (or split, around a stretch it spans)."""
    sub, file, start, stop = table
    if not len(direct[0]) or not len(sub):
        return table
    edges_lo = (direct[0] << _FILE_SHIFT) + direct[1]
    edges_hi = (direct[0] << _FILE_SHIFT) + direct[2]
    at, end = (file << _FILE_SHIFT) + start, (file << _FILE_SHIFT) + stop
    first = np.searchsorted(edges_hi, at, "right")  # the first stretch ending after the run starts
    last = np.searchsorted(edges_lo, end, "left")  # past the last stretch starting before the run ends
    touched = first < last
    keep = np.flatnonzero(~touched)
    parts = [(keep, sub[keep], file[keep], start[keep], stop[keep])]  # (row in plan order, sub, file, start, stop)
    extra = []  # the parts of touched runs outside every stretch (few: a dim-0 slice is one run per tensor)
    for r, i, j in zip(np.flatnonzero(touched).tolist(), first[touched].tolist(), last[touched].tolist()):
        base, lo = int(file[r]) << _FILE_SHIFT, int(at[r])
        for k in range(i, j):
            if edges_lo[k] > lo:
                extra.append((r, int(sub[r]), int(file[r]), lo - base, int(edges_lo[k]) - base))
            lo = int(edges_hi[k])
        if lo < end[r]:
            extra.append((r, int(sub[r]), int(file[r]), lo - base, int(stop[r])))
    if extra:
        more = np.array(extra, dtype=np.int64)
        parts.append(tuple(more[:, j] for j in range(5)))
    row, sub, file, start, stop = (np.concatenate([p[j] for p in parts]) for j in range(5))
    order = np.lexsort((start, row))  # each part where its run was: plan order, which ``_ascending`` and the waves follow
    return sub[order], file[order], start[order], stop[order]


_FILE_SHIFT = 40  # a byte's place in the job: file << 40 | offset (files < 2**40 bytes, fewer than 2**22 files)


def _ascending(tables: list[tuple[np.ndarray, ...]]) -> set[int]:
    """The submodules every rank reads in ascending byte order, each byte once (file, then offset): the ones a
    rank can read wave after wave, dropping each wave as its reads move on."""
    bad: set[int] = set()
    for sub, file, start, stop in tables:
        at, end = (file << _FILE_SHIFT) + start, (file << _FILE_SHIFT) + stop
        back = (sub[1:] == sub[:-1]) & (at[1:] < end[:-1])
        bad.update(sub[1:][back].tolist())
    return set(np.unique(np.concatenate([t[0] for t in tables])).tolist()) - bad


def _cut_waves(sub, file, start, stop, n_subs: int, n_files: int, wave_bytes: int, ascending: set[int]):
    """``(first_wave, cuts, n_waves)``: each submodule's first wave; for a submodule cut into several, the places
    (``file << 40 | offset``, ascending) where each of its next waves begins; and the number of waves."""
    keys, a, b = _merge(sub * n_files + file, start, stop)
    size_of = np.bincount(keys // n_files, weights=b - a, minlength=n_subs)  # bytes of each submodule's union
    first_wave, cuts = np.zeros(n_subs, dtype=np.int64), {}
    wave, size, left = 0, 0, int(size_of.sum())  # left: bytes from the current wave's start on
    budget = _wave_budget(left, wave_bytes)

    def next_wave() -> None:
        nonlocal wave, size, left, budget
        wave, size, left = wave + 1, 0, left - size
        budget = _wave_budget(left, wave_bytes)

    for i in range(n_subs):
        whole = i not in ascending or size_of[i] <= wave_bytes  # not cut: the submodule comes in one wave
        # closed only when a submodule follows (no empty last wave), and before one that would take it past
        # its budget (a wave of two layers, not two and a half: a rank holds its share of a whole wave)
        if size >= budget or (whole and size and size + size_of[i] > budget):
            next_wave()
        first_wave[i] = wave
        if whole:
            size += int(size_of[i])
            continue
        mine = keys // n_files == i
        places = []
        for lo, hi in zip(((keys[mine] % n_files) << _FILE_SHIFT) + a[mine], ((keys[mine] % n_files) << _FILE_SHIFT) + b[mine]):
            at = int(lo)
            while at < hi:
                if size >= budget:
                    next_wave()
                    places.append(at)
                take = min(int(hi) - at, budget - size)
                size, at = size + take, at + take
        cuts[i] = np.array(places, dtype=np.int64)
    return first_wave, cuts, wave + 1 if n_subs else 0


def _wave_budget(left: int, wave_bytes: int) -> int:
    """The size a wave closes at: ``wave_bytes``, but no more than 1/``_TAIL_SHARE`` of the shared bytes still to
    come (``left``), down to ``_MIN_TAIL_WAVE_BYTES``. A rank holds a wave's buffers beside the model loaded so far,
    which by the last waves is nearly all of it: small last waves keep its peak near the final model, where a wave
    early in the load costs nothing at the peak."""
    return min(wave_bytes, max(_MIN_TAIL_WAVE_BYTES, left // _TAIL_SHARE))


def _wave_runs(table, first_wave: np.ndarray, cuts: dict[int, np.ndarray]):
    """One rank's runs as ``(wave, file, start, stop)``: a run of a cut submodule that crosses a cut is split there."""
    sub, file, start, stop = table
    wave = first_wave[sub] if len(sub) else np.zeros(0, dtype=np.int64)
    extra = []  # the pieces of the runs that cross a cut: (wave, file, start, stop)
    keep = np.ones(len(sub), dtype=bool)
    for i, places in cuts.items():
        rows = np.flatnonzero(sub == i)
        at, end = (file[rows] << _FILE_SHIFT) + start[rows], (file[rows] << _FILE_SHIFT) + stop[rows]
        first, last = np.searchsorted(places, at, "right"), np.searchsorted(places, end - 1, "right")
        wave[rows] += first
        for r, k0, k1 in zip(rows[first != last].tolist(), first[first != last].tolist(), last[first != last].tolist()):
            base = int(file[r]) << _FILE_SHIFT
            bounds = [int(start[r]), *(places[k0:k1] - base).tolist(), int(stop[r])]
            extra += [(int(first_wave[i]) + k0 + k, int(file[r]), bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)]
            keep[r] = False
    if not extra:
        return wave, file, start, stop
    more = np.array(extra, dtype=np.int64).reshape(-1, 4)
    return tuple(np.concatenate([x[keep], more[:, j]]) for j, x in enumerate((wave, file, start, stop)))


def wave_span_bytes(span_bytes: int, world: int) -> int:
    """The span size: at most ``span_bytes``, and small enough that each rank owns ``FETCH_THREADS`` spans of a
    default wave, down to ``_MIN_SPAN_BYTES`` (the wave grows instead). A span is one connection, and a connection's
    rate is capped (a CDN's per-connection throughput, the benchmark's throttle): with 16 MiB spans, 3 ranks owned
    two spans of each 96 MiB wave and left half their fetch threads idle."""
    return min(span_bytes, max(_MIN_SPAN_BYTES, DEFAULT_WAVE_BYTES // (world * FETCH_THREADS)))


def default_wave_bytes(span_bytes: int, world: int) -> int:
    """The wave size when none is asked for: ``DEFAULT_WAVE_BYTES``, or more where that is too small for every
    rank to own ``FETCH_THREADS`` spans of ``span_bytes`` (spans stop shrinking at ``_MIN_SPAN_BYTES``)."""
    return max(DEFAULT_WAVE_BYTES, world * FETCH_THREADS * span_bytes)
