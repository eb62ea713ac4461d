"""Tensor-parallel sharding: which slice of each parameter this rank holds (its bytes: ``lowmem_hf.runs``).

The plan (which module gets which style) is transformers' own (``_resolve_parallel_plans``: the class
``_tp_plan`` merged with ``config.base_model_tp_plan`` and the caller's overrides). What a style does to a
parameter is the table below, mirroring ``transformers.distributed.tensor_parallel``'s ``shard_param``
methods; with a process group the DTensor placements transformers builds are checked against it, so the
two can never silently disagree.

Slices must divide evenly: transformers lets the last rank hold a shorter slice, but an attention
projection whose heads do not divide fails later in forward, so lowmem_hf refuses both up front.

Which bytes a slice is (element runs, chunks, boxes) is ``lowmem_hf.runs``, apart: the readers and writers need
that arithmetic without the planner.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import UnsupportedStyleError
from ..types import ShardSpec

__all__ = [
    "STYLE_SHARDING",
    "ShardSpec",
    "UnsupportedStyleError",
    "shard_specs",
    "slice_bounds",
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
