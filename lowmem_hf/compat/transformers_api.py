"""transformers names that are private or live in modules transformers treats as internal.

lowmem_hf reuses transformers' own loading knowledge (dtype decision, auto-class routing, TP plans, keep-in-fp32
rules, the finishing step that ties, initializes and recomputes buffers) instead of re-deriving it; these are the
entry points. Checked against transformers 5.23.0 (the declared floor and the pinned stack) and 5.24.0 (newest).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
from transformers.models.auto import auto_factory
from transformers.utils import loading_report

__all__ = [
    "TELEMETRY_KWARGS",
    "auto_model_base",
    "is_auto_class",
    "auto_model_mapping",
    "model_class_for",
    "decide_dtype",
    "dtype_plan",
    "resolve_parallel_plans",
    "parameter_plan",
    "dtensor_from_local_like",
    "new_loading_info",
    "finalize_model_loading",
    "record_weight_conversions",
    "mark_initialized",
    "set_attn_implementation",
    "set_experts_implementation",
    "keys_to_ignore_on_save",
    "device_mesh_of",
]

TELEMETRY_KWARGS = ("_from_auto", "_from_pipeline")
"""Keyword arguments transformers' own callers (auto classes, pipelines) add to ``from_pretrained``; they change
nothing about what is loaded."""


def auto_model_base() -> type:
    """The base class of every ``AutoModel*`` class (``auto_factory._BaseAutoModelClass``)."""
    return auto_factory._BaseAutoModelClass


def is_auto_class(obj: Any) -> bool:
    """Whether ``obj`` is an auto class (``AutoModelForCausalLM``, ...) rather than a concrete model class."""
    return isinstance(obj, type) and issubclass(obj, auto_factory._BaseAutoModelClass)


def auto_model_mapping(auto_class: type) -> Mapping[type, Any]:
    """An auto class's config-class -> model-class mapping (``_model_mapping``, a lazy mapping)."""
    return auto_class._model_mapping


def model_class_for(config: Any, auto_class: type) -> type:
    """The model class ``auto_class`` builds for ``config``, importing its module (``_get_model_class``)."""
    return auto_factory._get_model_class(config, auto_class._model_mapping)


def decide_dtype(
    dtype: Any, checkpoint_files: list[str] | None, config: Any, sharded_metadata: dict | None,
    state_dict: dict[str, torch.Tensor] | None, weights_only: bool,
) -> tuple[Any, torch.dtype]:
    """transformers' dtype decision (``modeling_utils._get_dtype``): the dtype the model is built in (``"auto"``: the
    config's, else the first checkpoint file's first floating tensor), written into ``config`` and its sub-configs.

    Returns:
        ``(config, dtype)``.
    """
    from transformers.modeling_utils import _get_dtype

    return _get_dtype(dtype, checkpoint_files, config, sharded_metadata, state_dict, weights_only)


def dtype_plan(model: Any, reference: torch.dtype) -> dict[str, Any]:
    """The model's keep-in-fp32 patterns at ``reference`` dtype (``PreTrainedModel._get_dtype_plan``)."""
    return model._get_dtype_plan(reference)


def resolve_parallel_plans(model: Any, distributed_config: Any) -> dict[str, str]:
    """The model's tensor-parallel plan for ``distributed_config``: the class plan merged with the config's and the
    caller's (``PreTrainedModel._resolve_parallel_plans``, whose first result is the TP plan)."""
    return model._resolve_parallel_plans(distributed_config)[0]


def parameter_plan(name: str, tp_plan: Mapping[str, str]) -> str | None:
    """The TP style transformers' wildcard plan gives parameter ``name`` (``parallel_utils._get_parameter_plan``)."""
    from transformers.distributed.parallel_utils import _get_parameter_plan

    return _get_parameter_plan(name, tp_plan)


def dtensor_from_local_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor holding ``local`` as this rank's shard, with ``like``'s mesh, placements and global shape
    (``sharding_utils._dtensor_from_local_like``: transformers' own way to wrap a loaded TP shard)."""
    from transformers.distributed.sharding_utils import _dtensor_from_local_like

    return _dtensor_from_local_like(local, like)


def new_loading_info(*, missing_keys: set[str], unexpected_keys: set[str], mismatched_keys: set) -> Any:
    """transformers' ``LoadStateDictInfo`` for a load, with empty error and conversion records. Fields a release
    does not have (``skipped_pp_keys`` is recent) are left out."""
    fields = {f.name for f in dataclasses.fields(loading_report.LoadStateDictInfo)}
    values = dict(
        missing_keys=missing_keys, unexpected_keys=unexpected_keys, mismatched_keys=mismatched_keys,
        error_msgs=[], conversion_errors={}, skipped_pp_keys=set(),
    )
    return loading_report.LoadStateDictInfo(**{k: v for k, v in values.items() if k in fields})


def finalize_model_loading(model: Any, load_config: Any, loading_info: Any) -> None:
    """transformers' finishing step after the weights are in (``PreTrainedModel._finalize_model_loading``): tie,
    rebuild non-persistent buffers, initialize what is missing, clean the key lists in ``loading_info``."""
    type(model)._finalize_model_loading(model, load_config, loading_info)


def record_weight_conversions(model: Any, conversions: list[Any]) -> None:
    """Keep the load-time key conversions on the model, where ``save_pretrained`` reverts them from
    (``_weight_conversions``)."""
    model._weight_conversions = list(conversions)


def mark_initialized(tensor: torch.Tensor) -> None:
    """Flag a loaded tensor so that transformers' init pass leaves it alone (``_is_hf_initialized``)."""
    tensor._is_hf_initialized = True


def set_attn_implementation(config: Any, value: str) -> None:
    """Set the attention implementation the model is built with (``config._attn_implementation``), as
    ``from_pretrained(attn_implementation=...)`` does."""
    config._attn_implementation = value


def set_experts_implementation(config: Any, value: str) -> None:
    """Set the MoE experts implementation (``config._experts_implementation``), as ``from_pretrained`` does."""
    config._experts_implementation = value


def keys_to_ignore_on_save(model: Any) -> tuple[str, ...]:
    """State-dict keys the model class declares ``save_pretrained`` must not write (``_keys_to_ignore_on_save``)."""
    return tuple(getattr(model, "_keys_to_ignore_on_save", None) or ())


def device_mesh_of(model: Any) -> Any:
    """The device mesh transformers attached to a distributed model (``_device_mesh``), else ``None``."""
    return getattr(model, "_device_mesh", None)
