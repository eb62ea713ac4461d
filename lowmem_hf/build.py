"""The model on ``meta`` and its dtype, as transformers decides them, with the guards transformers lacks: a config
value its model code fails on is named (file and field), a model vastly larger than its checkpoint is refused
while it is built, and a checkpoint none of whose tensors loads is refused before any byte is read.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from transformers import PreTrainedConfig

from .compat import transformers_api as hf
from .errors import LowMemError, NothingToLoadError, short_repr
from .request import LoadRequest
from .routing import config_error_message, config_source
from .types import Checkpoint, CheckpointFormat, LoadPlan
from .plan.dtypes import FLOAT_DTYPES
from .plan.skeleton import build_on_meta

__all__ = ["build", "decide_dtype", "reject_empty_plan", "OVERSIZE_FACTOR", "OVERSIZE_FLOOR"]


OVERSIZE_FACTOR = 1000
OVERSIZE_FLOOR = 10**8
"""A model is refused while it is built on meta once its parameters pass both ``OVERSIZE_FACTOR`` times the elements
the checkpoint stores and ``OVERSIZE_FLOOR`` elements: no checkpoint fills 0.1% of its model, and a config value off
by orders of magnitude would otherwise build modules for hours (transformers' own from_pretrained never returns)."""


def build(
    request: LoadRequest, model_class: type, config: Any, dtype: torch.dtype, model_kwargs: dict[str, Any], checkpoint: Checkpoint,
    *, name_config_errors: bool = True,
):
    """``build_on_meta``, with the errors transformers' model code raises on nonsense config values (a ``KeyError``
    for an unknown ``rope_type``, a ``ZeroDivisionError`` for ``num_key_value_heads=0``, torch's ``RuntimeError`` for
    a negative size) wrapped into a ``ValueError`` naming the config file and the fields, as ``routing`` does for the config's own code;
    and a model vastly larger than the checkpoint refused while it is built (``_oversized``). ``name_config_errors``:
    the engine's (``Engine.names_config_errors``); False lets every build error pass as it is."""
    stored = sum(math.prod(info.shape) for info in checkpoint.tensors.values())
    try:
        return build_on_meta(
            model_class, config, dtype, request.model_args, model_kwargs,
            max_numel=max(OVERSIZE_FACTOR * stored, OVERSIZE_FLOOR),
            describe=lambda built: _oversized(request, config, checkpoint, stored, built),
        )
    except (KeyError, IndexError, ZeroDivisionError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        if isinstance(e, LowMemError) or not name_config_errors:
            raise
        if isinstance(request.config, PreTrainedConfig):
            source, values = "the config passed as config=", request.config.to_dict()
        else:
            source, values = config_source(request), None
            if source is None:
                raise
        raise ValueError(
            config_error_message(e, source, request, what=f"{model_class.__name__}", values=values)
        ) from e


def _oversized(request: LoadRequest, config: Any, checkpoint: Checkpoint, stored: int, built: int) -> str:
    biggest = max((d for info in checkpoint.tensors.values() for d in info.shape), default=0)
    suspects = [
        f"{k}={v}" for k, v in sorted(config.to_dict().items())
        if isinstance(v, int) and not isinstance(v, bool) and v > biggest
    ]
    return (
        f"{config_source(request) or 'the config'} builds a model that already has {built:,} parameters, over "
        f"{OVERSIZE_FACTOR}x the {stored:,} elements the checkpoint {checkpoint.name_or_path} stores: a size in the "
        f"config is off" + (f" ({', '.join(suspects)}: larger than any dimension the checkpoint stores)" if suspects else "")
        + ". Fix the config (or pass a config that matches the weights)."
    )


def decide_dtype(request: LoadRequest, config: Any, checkpoint: Checkpoint) -> tuple[Any, torch.dtype]:
    """transformers' own dtype decision: the declared dtype (``"auto"``: config, else the first file's tensors).

    Raises:
        ValueError: ``"auto"`` chose a dtype transformers cannot build a model in (a float8 checkpoint whose
            config.json names float8 or no dtype): transformers fails on it with a raw ``TypeError`` about a storage
            class while building the model.
    """
    declared = getattr(config, "dtype", None)
    config, dtype = _get_dtype_as_transformers(request, config, checkpoint)
    if dtype not in FLOAT_DTYPES:
        if declared is not None:
            origin = f"the config's dtype ({config_source(request) or 'config='}: dtype={str(declared).removeprefix('torch.')!r})"
        else:
            first = next((i for i in checkpoint.tensors.values() if i.file == checkpoint.files[0] and i.dtype == dtype), None)
            origin = f"the stored dtype of the first floating tensor in {checkpoint.files[0]}" + (f" ({first.key!r})" if first else "")
        raise ValueError(
            f"dtype={short_repr(request.dtype or 'auto')} chose {dtype}, {origin}: transformers builds models only in "
            f"{', '.join(str(d) for d in FLOAT_DTYPES)} (its own from_pretrained fails on {dtype} with a TypeError while "
            "building the model). Pass dtype=torch.bfloat16 (or another of those) to cast the stored tensors to it, "
            "as transformers does with that argument."
        )
    return config, dtype


def _get_dtype_as_transformers(request: LoadRequest, config: Any, checkpoint: Checkpoint) -> tuple[Any, torch.dtype]:
    sharded_metadata = dict(checkpoint.index_metadata) if checkpoint.index_metadata is not None else None
    local_files = [checkpoint.local_paths.get(f, f) for f in checkpoint.files]
    if checkpoint.format != CheckpointFormat.DCP and all(os.path.isfile(f) for f in local_files):
        return hf.decide_dtype(request.dtype, local_files, config, sharded_metadata, None, request.weights_only)
    # transformers infers "auto" from the first file's tensors; the remote headers already say what they are
    first = [i for i in checkpoint.tensors.values() if i.file == checkpoint.files[0]]
    meta_state = {i.key: torch.empty(0, dtype=i.dtype, device="meta") for i in first}
    return hf.decide_dtype(request.dtype, None, config, sharded_metadata, meta_state, request.weights_only)


def reject_empty_plan(plan: LoadPlan, checkpoint: Checkpoint, model: Any, path: str) -> None:
    """A checkpoint none of whose tensors loads gives a fully re-initialized model: that is never a load, whatever
    ``ignore_mismatched_sizes`` says (it turns mismatches into re-initialized tensors one by one)."""
    if not checkpoint.tensors or plan.reads_per_file():
        return
    examples = sorted(checkpoint.tensors)[:3]
    raise NothingToLoadError(
        f"Not one of the {len(checkpoint.tensors)} tensors in {path} loads into {type(model).__name__}: "
        f"{len(plan.mismatched_keys)} have another shape than the model's parameter (ignored with "
        f"ignore_mismatched_sizes=True), {len(plan.unexpected_keys)} match no parameter (e.g. {examples}). "
        "The checkpoint does not belong to this model: check the path, the auto class and the config "
        "(keyword overrides such as vocab_size=... change the shapes)."
    )
