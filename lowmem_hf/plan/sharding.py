"""Tensor-parallel sharding: which slice of each parameter this rank holds, and which bytes that is.

The plan (which module gets which style) is transformers' own (``_resolve_parallel_plans``: the class
``_tp_plan`` merged with ``config.base_model_tp_plan`` and the caller's overrides). What a style does to a
parameter is the table below, mirroring ``transformers.distributed.tensor_parallel``'s ``shard_param``
methods; with a process group the DTensor placements transformers builds are checked against it, so the
two can never silently disagree.

Slices must divide evenly: transformers lets the last rank hold a shorter slice, but an attention
projection whose heads do not divide fails later in forward, so lowmem_hf refuses both up front.

The arithmetic every reader and writer shares is here too, pure: a slice as element runs of the stored tensor
(``element_runs``), runs cut into chunks (``chunk_runs``, ``split_runs``, ``chunk_spans``), and boxes (``overlap``,
``box_runs``: a rank's slice against the chunks a sharded training checkpoint stores, or a shard written in place).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Mapping

import torch

from ..errors import UnsupportedStyleError
from ..types import ShardSpec

__all__ = [
    "STYLE_SHARDING",
    "ShardSpec",
    "UnsupportedStyleError",
    "shard_specs",
    "slice_bounds",
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
    "check_head_divisibility",
]


def _out_dim(ndim: int, leaf: str) -> int | None:
    return max(ndim - 2, 0)


def _in_dim(ndim: int, leaf: str) -> int | None:
    return None if leaf == "bias" else ndim - 1


# style -> function(ndim, parameter leaf name) -> sharded dim, or None for replicated.
STYLE_SHARDING = {
    "colwise": _out_dim,
    "colwise_gather_output": _out_dim,
    "colwise_rep": _out_dim,
    "rowwise": _in_dim,
    "rowwise_split_input": _in_dim,
    "rowwise_rep": _in_dim,
    "embedding_rowwise": lambda ndim, leaf: 0,
    "embedding_colwise": lambda ndim, leaf: 1,
    "replicate": lambda ndim, leaf: None,
    "replicated_with_grad_allreduce": lambda ndim, leaf: None,
    "all_reduce": lambda ndim, leaf: None,
    "sequence_parallel": lambda ndim, leaf: None,
}


def slice_bounds(size: int, rank: int, tp_size: int) -> tuple[int, int]:
    """``[start, stop)`` of rank ``rank``'s equal share of ``size`` (``size`` must divide by ``tp_size``)."""
    step = size // tp_size
    return rank * step, (rank + 1) * step


def shard_specs(
    params: Mapping[str, tuple[int, ...]],
    tp_plan: Mapping[str, str],
    *,
    tp_rank: int,
    tp_size: int,
) -> dict[str, ShardSpec]:
    """The ``ShardSpec`` of every sharded parameter; replicated ones are absent.

    Args:
        params: global shapes of the model's parameters, by name.
        tp_plan: transformers' resolved plan, ``{module_or_param_name: style}`` with layer numbers expanded.

    Raises:
        UnsupportedStyleError: a style this table does not know (names the style and the module).
        ValueError: a sharded dimension that ``tp_size`` does not divide (names parameter, dimension, sizes).
    """
    specs = {}
    for name, shape in params.items():
        style = tp_plan.get(name)
        if style is None:
            continue
        rule = STYLE_SHARDING.get(style)
        if rule is None:
            raise UnsupportedStyleError(
                f"tp_plan style {style!r} on {name.rpartition('.')[0] or name} cannot be sliced at read time by "
                f"lowmem_hf (supported: {', '.join(sorted(STYLE_SHARDING))}). Override it with "
                f"tp_plan={{{name.rpartition('.')[0]!r}: 'replicate'}} or load without tensor parallelism."
            )
        dim = rule(len(shape), name.rpartition(".")[2])
        if dim is None:
            continue
        if shape[dim] % tp_size:
            raise ValueError(
                f"{name} has {shape[dim]} along dimension {dim} (shape {list(shape)}, style {style!r}), which "
                f"tp_size={tp_size} does not divide; choose a tp_size that divides {shape[dim]}."
            )
        start, stop = slice_bounds(shape[dim], tp_rank, tp_size)
        specs[name] = ShardSpec(style, dim, start, stop, tp_rank, tp_size)
    return specs


# Config attributes that count attention heads, and the projections whose rows are those heads.
_HEAD_COUNTS = {
    "num_attention_heads": ("q_proj", "qkv_proj", "query"),
    "num_key_value_heads": ("k_proj", "v_proj", "key", "value"),
}


def check_head_divisibility(config: Any, specs: Mapping[str, ShardSpec], tp_size: int) -> None:
    """Refuse a tp_size that splits an attention head: the weight rows may divide while the heads do not.

    (transformers loads such a model and fails in forward with a reshape error.)
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr, projections in _HEAD_COUNTS.items():
        heads = getattr(text, attr, None)
        if not isinstance(heads, int) or heads % tp_size == 0:
            continue
        hit = next(
            (n for n in specs if n.rpartition(".")[0].rpartition(".")[2] in projections and specs[n].dim == 0), None
        )
        if hit is not None:
            raise ValueError(
                f"{hit} is sharded by attention head, but {attr}={heads} does not divide by tp_size={tp_size}; "
                f"choose a tp_size that divides the number of heads ({heads})."
            )


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

