"""The planner: which bytes go into which parameter, in which dtype, submodule by submodule.

Everything is decided here, from headers and the meta skeleton, before any tensor byte is read: a
shape mismatch or an unknown policy fails before I/O, and the stream stage only executes the plan.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import ShapeMismatchError, UnsupportedConversionError
from ..types import Checkpoint, ConversionRead, DtypeDecision, LoadPlan, ShardSpec, SubmodulePlan, TensorRead
from .dtypes import DtypePolicy
from .keys import KeyMapping

__all__ = ["make_plan", "submodule_of"]


def submodule_of(name: str) -> str:
    """The streaming unit a model key belongs to: the first indexed block (``model.layers.3``), else its module.

    ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``; ``model.embed_tokens.weight`` ->
    ``model.embed_tokens``; ``lm_head.weight`` -> ``lm_head``.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def make_plan(
    model: Any,
    checkpoint: Checkpoint,
    mapping: KeyMapping,
    policy: DtypePolicy,
    *,
    ignore_mismatched_sizes: bool,
    shards: Mapping[str, ShardSpec] | None = None,
) -> LoadPlan:
    """Turn the key mapping into per-submodule reads with dtype decisions.

    Raises:
        ShapeMismatchError: a stored shape differs from its parameter and ``ignore_mismatched_sizes`` is False.
    """
    shards = dict(shards or {})
    model_tensors = model.state_dict(keep_vars=True)  # the parameters themselves: ZeRO-3 keeps the shape on them
    reads: list[TensorRead] = []
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    for target, key in mapping.direct.items():
        info = checkpoint.tensors[key]
        ref = model_tensors[target]
        if global_shape(ref) != info.shape:
            # shapes as transformers' loading info gives them (torch.Size), which scripts compare against
            mismatched.append((target, torch.Size(info.shape), torch.Size(global_shape(ref))))
            continue
        decision = policy.decide(target, stored=info.dtype, module=ref.dtype)
        reads.append(TensorRead(target, info, decision, shards.get(target)))

    if mismatched and not ignore_mismatched_sizes:
        raise _mismatch_error(model, checkpoint, mapping, mismatched)

    conversions: list[ConversionRead] = []
    for first_target, (converter, sources) in mapping.converted.items():
        if shards:
            raise UnsupportedConversionError(
                f"{type(model).__name__} (model_type={model.config.model_type!r}): transformers converts checkpoint keys "
                f"{[k for _, k in sources][:2]}... into {first_target} with {converter!r}; lowmem_hf cannot slice a "
                "converted tensor per rank. Load it without tensor parallelism, or re-save the checkpoint with "
                "transformers (save_pretrained) in the model's own layout."
            )
        ref = model_tensors[first_target]
        infos = tuple((pattern, checkpoint.tensors[key]) for pattern, key in sources)
        # transformers casts every source to the first target's dtype before converting
        decision = policy.decide(first_target, stored=infos[0][1].dtype, module=ref.dtype)
        conversions.append(ConversionRead(first_target, converter, infos, decision))

    loaded = {r.target for r in reads} | {t for c in conversions for t in _converted_targets(c)}
    missing = frozenset(k for k in model_tensors if k not in loaded and k not in {m[0] for m in mismatched})

    return LoadPlan(
        submodules=_group(reads, conversions, checkpoint),
        missing_keys=missing,
        unexpected_keys=mapping.unexpected,
        mismatched_keys=frozenset(mismatched),
        dtype=policy.dtype,
        weight_conversions=mapping.used_transforms,
        shards=shards,
    )


def _mismatch_error(
    model: Any, checkpoint: Checkpoint, mapping: KeyMapping, mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
) -> ShapeMismatchError:
    """Every tensor whose stored shape does not fit its parameter, with the checkpoint key and file of each."""
    lines = "\n".join(
        f"  {target}: checkpoint {list(stored)} ({mapping.direct[target]} in "
        f"{checkpoint.tensors[mapping.direct[target]].file}), model {list(wanted)}"
        for target, stored, wanted in sorted(mismatched)
    )
    return ShapeMismatchError(
        f"{len(mismatched)} checkpoint tensor(s) do not fit the {type(model).__name__} built from the config:\n"
        f"{lines}\nCheck that the config matches the checkpoint, or pass ignore_mismatched_sizes=True to "
        "initialize these parameters instead of loading them (e.g. a new classification head)."
    )


def global_shape(t: Any) -> tuple[int, ...]:
    """A parameter's full shape: a DeepSpeed ZeRO-3 placeholder is empty and keeps its shape as ``ds_shape``."""
    return tuple(getattr(t, "ds_shape", t.shape))


def _converted_targets(conversion: ConversionRead) -> list[str]:
    """The model keys a converter group fills (transformers names them by swapping the first target pattern)."""
    patterns = conversion.converter.target_patterns
    return [conversion.first_target.replace(patterns[0], p) for p in patterns]


def _group(reads: list[TensorRead], conversions: list[ConversionRead], checkpoint: Checkpoint) -> tuple[SubmodulePlan, ...]:
    """Group reads by submodule and order submodules by where their bytes start, so files are read front to back."""
    file_rank = {f: i for i, f in enumerate(checkpoint.files)}
    key_rank = {k: i for i, k in enumerate(checkpoint.tensors)}

    def position(info) -> tuple[int, int]:
        return (file_rank[info.file], info.offset if info.offset is not None else key_rank[info.key])

    by_name: dict[str, tuple[list[TensorRead], list[ConversionRead]]] = {}
    for r in reads:
        by_name.setdefault(submodule_of(r.target), ([], []))[0].append(r)
    for c in conversions:
        by_name.setdefault(submodule_of(c.first_target), ([], []))[1].append(c)

    plans = []
    for name, (rs, cs) in by_name.items():
        rs.sort(key=lambda r: position(r.source))
        plans.append(SubmodulePlan(name=name, reads=tuple(rs), conversions=tuple(cs)))

    def first_byte(plan: SubmodulePlan) -> tuple[int, int]:
        infos = [r.source for r in plan.reads] + [i for c in plan.conversions for _, i in c.sources]
        return min(position(i) for i in infos)

    return tuple(sorted(plans, key=first_byte))


def decisions_of(plan: LoadPlan) -> dict[str, DtypeDecision]:
    """Every loaded tensor's dtype decision, by model key."""
    out = {r.target: r.decision for r in plan.reads}
    for s in plan.submodules:
        for c in s.conversions:
            for target in _converted_targets(c):
                out[target] = c.decision
    return out
