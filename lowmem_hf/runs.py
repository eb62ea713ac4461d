"""Element runs: which elements of a row-major stored tensor make up a slice, cut into chunks, and boxes.

Pure arithmetic every reader (``formats/``), byte source (``sources/exchange.py``) and writer (``save``) shares, with
the planner's shard specs as its only input type. It sits below every stage, so a stage that reads bytes need not
import the planner: ``element_runs`` (a slice as runs of the stored tensor), ``chunk_runs``, ``split_runs`` and
``chunk_spans`` (runs cut into chunks of at most ``chunk_bytes``), and boxes (``wanted_box``, ``overlap``,
``box_runs``, ``flat_box_runs``: a rank's slice against the chunks a sharded training checkpoint stores, or a shard
written in place). ``slice_tensor`` cuts the same slice out of a tensor already in memory.
"""

from __future__ import annotations

import itertools
import math

import torch

from .types import ShardSpec

__all__ = [
    "element_runs",
    "interval_runs",
    "chunk_runs",
    "split_runs",
    "chunk_spans",
    "wanted_box",
    "overlap",
    "box_runs",
    "flat_box_runs",
    "slice_tensor",
    "element_extent",
]


def element_runs(shape: tuple[int, ...], spec: ShardSpec | None) -> list[tuple[int, int]]:
    """Contiguous ``(source_element_offset, n_elements)`` runs of a row-major tensor that make up the slice.

    Concatenated in order, the runs are the local tensor in row-major order. A dim-0 slice is one run;
    a slice of dim ``d`` is one run per index of the dims before ``d``. With ``spec.intervals`` (meshes),
    the runs of the last partial dim repeat for every kept index of the dims before it; adjacent runs merge,
    so a read is never split where the bytes are contiguous.
    """
    numel = math.prod(shape)
    if spec is None:
        return [(0, numel)] if numel else []
    if spec.flat:
        return [(spec.start, spec.stop - spec.start)] if spec.stop > spec.start else []
    if spec.intervals is None:
        inner = math.prod(shape[spec.dim + 1 :])
        outer = math.prod(shape[: spec.dim])
        stride = shape[spec.dim] * inner
        length = (spec.stop - spec.start) * inner
        if length == 0:
            return []
        return [(o * stride + spec.start * inner, length) for o in range(outer)]
    return interval_runs(shape, spec.intervals)


def element_extent(shape: tuple[int, ...], spec: ShardSpec | None) -> tuple[int, int, int]:
    """``(first, stop, needed)`` of ``element_runs(shape, spec)`` without listing the runs: the first element, one past
    the last, and how many the runs hold. A read-ahead hint needs only these, and a rowwise slice of a TP x FSDP mesh
    is one run per row (thousands per tensor at 70B), so listing them twice per tensor cost more than the hint."""
    numel = math.prod(shape)
    if spec is None:
        return (0, numel, numel)
    if spec.flat:
        return (spec.start, spec.stop, spec.stop - spec.start) if spec.stop > spec.start else (0, 0, 0)
    intervals = spec.intervals
    if intervals is None:
        intervals = tuple(((spec.start, spec.stop),) if d == spec.dim else ((0, n),) for d, n in enumerate(shape))
    needed = math.prod(sum(b - a for a, b in runs) for runs in intervals)
    if needed == 0:
        return (0, 0, 0)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    first = sum(runs[0][0] * stride for runs, stride in zip(intervals, strides))
    last = sum((runs[-1][1] - 1) * stride for runs, stride in zip(intervals, strides))
    return (first, last + 1, needed)


def interval_runs(shape: tuple[int, ...], intervals: tuple[tuple[tuple[int, int], ...], ...]) -> list[tuple[int, int]]:
    """``element_runs`` for per-dim index runs: the row-major element runs of their cartesian product, merged."""
    if any(not runs for runs in intervals) or math.prod(shape) == 0:
        return []
    partial = [d for d, runs in enumerate(intervals) if runs != ((0, shape[d]),)]
    if not partial:
        return [(0, math.prod(shape))]
    last = partial[-1]
    inner = math.prod(shape[last + 1 :])
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    bases = [0]
    for d in range(last):  # every kept index of the dims before the last partial one
        offsets = [i * strides[d] for a, b in intervals[d] for i in range(a, b)]
        bases = [base + o for base in bases for o in offsets]
    out: list[tuple[int, int]] = []
    for base in bases:
        for a, b in intervals[last]:
            start, n = base + a * inner, (b - a) * inner
            if out and out[-1][0] + out[-1][1] == start:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((start, n))
    return out


def chunk_runs(runs: list[tuple[int, int]], itemsize: int, chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Group runs into chunks of at most ``chunk_bytes`` (splitting long runs): ``[[(src, dst, n), ...], ...]``.

    ``src`` is the element offset in the stored tensor, ``dst`` in the local destination (the runs, in order).
    """
    placed, dst = [], 0
    for src, n in runs:
        placed.append((src, dst, n))
        dst += n
    return split_runs(placed, itemsize, chunk_bytes)


def split_runs(runs: list[tuple[int, int, int]], itemsize: int, chunk_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Group ``(src, dst, n)`` runs into jobs of at most ``chunk_bytes`` (long runs split; at least one element)."""
    limit = max(1, chunk_bytes // itemsize)
    jobs: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    used = 0
    for src, dst, n in runs:
        while n:
            take = min(n, limit - used)
            current.append((src, dst, take))
            src, dst, n, used = src + take, dst + take, n - take, used + take
            if used == limit:
                jobs.append(current)
                current, used = [], 0
    if current:
        jobs.append(current)
    return jobs


def wanted_box(shape: tuple[int, ...], shard: ShardSpec | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(start, stop)`` of this rank's part of a global tensor: all of it, or ``shard``'s slice."""
    start, stop = [0] * len(shape), list(shape)
    if shard is not None:
        start[shard.dim], stop[shard.dim] = shard.start, shard.stop
    return tuple(start), tuple(stop)


def overlap(
    chunk_offsets: tuple[int, ...], chunk_sizes: tuple[int, ...], start: tuple[int, ...], stop: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection ``(lo, hi)`` (global coordinates) of a stored chunk with the box ``[start, stop)``, or None."""
    lo = tuple(max(o, s) for o, s in zip(chunk_offsets, start))
    hi = tuple(min(o + n, e) for o, n, e in zip(chunk_offsets, chunk_sizes, stop))
    if any(h <= l for l, h in zip(lo, hi)) and len(lo):
        return None
    return lo, hi


def box_runs(
    src_shape: tuple[int, ...], src_start: tuple[int, ...], dst_shape: tuple[int, ...], dst_start: tuple[int, ...],
    size: tuple[int, ...],
) -> list[tuple[int, int, int]]:
    """Copy a box of ``size`` from ``src_start`` in a row-major ``src_shape`` tensor to ``dst_start`` in ``dst_shape``:
    the contiguous ``(src_element, dst_element, n)`` runs, in source order.

    Trailing dimensions the box covers fully in both tensors merge into one run, so a whole chunk read into a
    whole destination is a single run, and a dim-0 slice of a dim-0 chunk too.
    """
    nd = len(size)
    if nd == 0:
        return [(0, 0, 1)]
    if any(n == 0 for n in size):
        return []
    src_strides = [math.prod(src_shape[d + 1 :]) for d in range(nd)]
    dst_strides = [math.prod(dst_shape[d + 1 :]) for d in range(nd)]
    # merge trailing dims: dim d joins the run if every dim after it is covered whole in src and dst
    first = nd - 1
    while first > 0 and size[first] == src_shape[first] == dst_shape[first]:
        first -= 1
    run = size[first] * src_strides[first]
    src0 = sum(s * st for s, st in zip(src_start, src_strides))
    dst0 = sum(s * st for s, st in zip(dst_start, dst_strides))
    runs = []
    for index in itertools.product(*(range(n) for n in size[:first])):
        s = src0 + sum(i * st for i, st in zip(index, src_strides))
        d = dst0 + sum(i * st for i, st in zip(index, dst_strides))
        runs.append((s, d, run))
    return runs


def flat_box_runs(
    shape: tuple[int, ...], chunk_offsets: tuple[int, ...], chunk_sizes: tuple[int, ...], start: int, stop: int
) -> list[tuple[int, int, int]]:
    """The elements ``[start, stop)`` of the flattened global tensor (a ZeRO-3 partition) that a stored chunk
    (the box ``chunk_offsets + chunk_sizes``) holds: ``(chunk_element, dst_element, n)`` runs, ``dst`` counted
    from ``start``, in source order. A flat range is not a box, so the chunk is walked as its row-major runs in
    the global tensor (one run for a chunk that is whole rows) and each run is cut to the range."""
    ndim = len(shape)
    runs = []
    for src, at, n in box_runs(chunk_sizes, (0,) * ndim, shape, chunk_offsets, chunk_sizes):
        if at >= stop:
            break  # runs come in increasing global order
        lo, hi = max(at, start), min(at + n, stop)
        if lo < hi:
            runs.append((src + lo - at, lo - start, hi - lo))
    return runs


def chunk_spans(numel: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` covering ``numel`` elements, each at most ``chunk_bytes`` bytes (min one element)."""
    step = max(1, chunk_bytes // itemsize)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def slice_tensor(t: torch.Tensor, shard: ShardSpec | None) -> torch.Tensor:
    """``t``'s slice described by ``shard``: a view for one range per dim, a copy where a dim has several runs."""
    if shard is None:
        return t
    if shard.flat:
        return t.reshape(-1).narrow(0, shard.start, shard.stop - shard.start)
    if shard.intervals is None:
        return t.narrow(shard.dim, shard.start, shard.stop - shard.start)
    for dim, runs in enumerate(shard.intervals):
        if runs == ((0, t.shape[dim]),):
            continue
        if len(runs) == 1:
            t = t.narrow(dim, runs[0][0], runs[0][1] - runs[0][0])
        else:  # several runs (a strided shard) or none (an uneven shard that left this rank nothing)
            t = torch.cat([t.narrow(dim, a, b - a) for a, b in runs], dim=dim) if runs else t.narrow(dim, 0, 0)
    return t
