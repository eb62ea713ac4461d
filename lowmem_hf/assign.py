"""Assign: put loaded tensors into the meta skeleton in place, then finish the model as transformers does.

Finishing (tie, non-persistent buffers, missing-weight init, key clean-up) is transformers' own
finishing step (``compat.transformers_api.finalize_model_loading``): the model's ``_init_weights``, tied-weight declarations and RoPE buffer
recomputation are its knowledge, and calling the same code in the same order consumes the RNG exactly
as ``from_pretrained`` does, so even randomly initialized heads come out bit-identical under one seed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import SkipParameters
from transformers.modeling_utils import LoadStateDictConfig

from .compat import torch_api
from .compat import transformers_api as hf
from .errors import IncompleteLoadError, ShapeMismatchError
from .types import ConversionRead, DtypeDecision, LoadPlan
from .distributed.zero3 import held

__all__ = ["set_tensor", "assign_submodule", "finalize", "check_loaded", "model_nbytes"]


@torch.no_grad()
def set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` by ``value``, keeping the Parameter class and ``requires_grad``."""
    module_path, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if leaf == torch_api.EXTRA_STATE_SUFFIX:
        module.set_extra_state(value)
        return
    if torch_api.has_parameter_slot(module, leaf):
        ref = torch_api.parameter_slot(module, leaf)
        cls = type(ref) if ref is not None else torch.nn.Parameter
        if ref is not None and isinstance(ref.data, DTensor):
            # A tensor-parallel parameter: this rank's slice becomes the local shard of a DTensor with the
            # placements transformers gave the meta parameter (a Parameter of a DTensor reports the DTensor class).
            value = hf.dtensor_from_local_like(value, ref.data)
            cls = torch.nn.Parameter
        requires_grad = ref.requires_grad if ref is not None else value.is_floating_point()
        param = cls(value, requires_grad=requires_grad and (value.is_floating_point() or value.is_complex()))
        # transformers' init pass skips tensors carrying this flag: loaded weights must not be re-initialized
        hf.mark_initialized(param)
        torch_api.put_parameter(module, leaf, param)
    else:
        hf.mark_initialized(value)
        torch_api.put_buffer(module, leaf, value)


def assign_submodule(
    model: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    staged: list[tuple[ConversionRead, list[torch.Tensor]]],
    loading_info: Any,
    *,
    in_place: bool = False,
) -> None:
    """Assign one submodule's tensors; run transformers' converters on its staged groups first.

    ``in_place``: parameters whose values were read into their own memory (DeepSpeed ZeRO-3 partitions) stay the
    objects DeepSpeed made; they are only marked loaded. Buffers are assigned as always.
    """
    for name, value in tensors.items():
        if in_place and _is_partition_of(model, name, value):
            hf.mark_initialized(model.get_parameter(name))  # transformers' init pass must not overwrite it
        else:
            set_tensor(model, name, value)
        loading_info.missing_keys.discard(name)
    for conversion, inputs in staged:
        converter = conversion.converter
        for (pattern, info), tensor in zip(conversion.sources, inputs):
            converter.add_tensor(conversion.first_target, info.key, pattern, (lambda t=tensor: t))
        inputs.clear()  # the converter holds the only references now; it drops them as it converts
        try:
            realized = converter.convert(conversion.first_target, model=model, config=model.config, loading_info=loading_info)
        except SkipParameters as skipped:
            # transformers records the converter's error and raises its own RuntimeError from the load report;
            # the converter's exception is the context of SkipParameters (raised inside its except block)
            details = "\n".join(
                f"{key}: {message.strip().splitlines()[-1] if message.strip() else message}"
                for key, message in loading_info.conversion_errors.items()
            )
            raise RuntimeError(
                "We encountered some issues during automatic conversion of the weights. "
                f"{converter!r} failed for {conversion.first_target} from "
                f"{[info.key for _, info in conversion.sources][:4]}:\n{details}"
            ) from skipped.__context__
        for name, value in realized.items():
            value = value[0] if isinstance(value, list) else value
            ref = model.get_parameter_or_buffer(name)
            if tuple(ref.shape) != tuple(value.shape):
                raise ShapeMismatchError(
                    f"{name}: converting {[i.key for _, i in conversion.sources][:3]}... with {converter!r} "
                    f"gives shape {list(value.shape)}, the model expects {list(ref.shape)}. "
                    "Check that the config matches the checkpoint."
                )
            set_tensor(model, name, value.contiguous())
            loading_info.missing_keys.discard(name)


def _is_partition_of(model: torch.nn.Module, name: str, value: torch.Tensor) -> bool:
    try:
        param = model.get_parameter(name)
    except AttributeError:
        return False  # a buffer
    partition = held(param)
    return partition is not param and value.untyped_storage().data_ptr() == partition.untyped_storage().data_ptr()


def finalize(
    model: Any,
    plan: LoadPlan,
    loading_info: Any,
    *,
    device: torch.device,
    name_or_path: str,
    ignore_mismatched_sizes: bool,
    device_mesh: Any = None,
) -> None:
    """Tie, rebuild non-persistent buffers, initialize what the checkpoint lacks: transformers' own finishing step."""
    config = LoadStateDictConfig(
        pretrained_model_name_or_path=name_or_path,
        ignore_mismatched_sizes=ignore_mismatched_sizes,
        device_map={"": device},
        dtype=plan.dtype,
        device_mesh=device_mesh,
    )
    hf.finalize_model_loading(model, config, loading_info)
    hf.record_weight_conversions(model, plan.weight_conversions)


def model_nbytes(model: torch.nn.Module) -> int:
    """Bytes of every unique parameter and buffer storage held by this process (local shards under TP)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        if isinstance(t.data, DTensor):
            t = t.data.to_local()  # this rank's bytes
        t = held(t)  # a ZeRO-3 partition
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def check_loaded(model: torch.nn.Module, decisions: dict[str, DtypeDecision], device: torch.device) -> None:
    """Post-conditions: nothing on ``meta``, every loaded tensor has its decided dtype and the target device.

    Raises:
        IncompleteLoadError: naming every tensor that breaks one, so a half-loaded model is never returned.
    """
    problems = []
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if t.device.type == "meta":
            problems.append(f"{name} is still on meta")
        elif t.device != device and t.device.type != device.type:
            problems.append(f"{name} is on {t.device}, expected {device}")
    for name, decision in decisions.items():
        try:
            t = model.get_parameter_or_buffer(name)
        except AttributeError:
            continue  # a converter target transformers dropped (e.g. an optional bias)
        if t.dtype != decision.dtype:
            problems.append(f"{name} is {t.dtype}, the dtype policy decided {decision.dtype} ({decision.rule})")
    if problems:
        shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise IncompleteLoadError(
            f"{type(model).__name__} did not load completely:\n  {shown}\n"
            "This is a lowmem_hf bug or an unsupported model; please report it with the model's config."
        )


@torch.no_grad()
def apply_missing_overrides(model: torch.nn.Module, policy: Any, missing_keys: set[str]) -> None:
    """Give initialized (not loaded) tensors the dtype a ``dtype_overrides`` rule asks for.

    Loaded tensors got their override when read; without this, an override like ``*.norm.weight``
    would silently skip norms the checkpoint lacks.
    """
    for name in sorted(missing_keys):
        decision = policy.override_for(name)
        if decision is None:
            continue
        t = model.get_parameter_or_buffer(name)
        if t.is_floating_point() and t.dtype != decision.dtype:
            set_tensor(model, name, t.detach().to(decision.dtype))
