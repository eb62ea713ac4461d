"""What a save writes: the tensors transformers' ``save_pretrained`` would write (tied ones once, in the dtype
asked), the process group whose ranks write them, and the config files."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..compat.transformers_api import keys_to_ignore_on_save
from ..distributed.group import current_group
from ..formats.safetensors import TAGS

if TYPE_CHECKING:
    from .commit import Staging

__all__ = ["Entry", "entries_of", "group_of", "refuse_local_slices", "as_shard", "write_configs"]


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name, the model's tensor (maybe a DTensor) and the dtype it is written in."""

    name: str
    tensor: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)  # global shape for a DTensor

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def group_of(model: Any):
    """The process group whose ranks all take part: the TP mesh's, else the default group, else none."""
    for p in model.parameters():
        if isinstance(p.data, DTensor):
            mesh = p.data.device_mesh
            if mesh.ndim != 1:
                raise NotImplementedError(
                    f"{type(model).__name__} is sharded over a {mesh.ndim}-D device mesh {mesh.mesh_dim_names}; "
                    "lowmem_hf.save_pretrained saves 1-D tensor-parallel models. Use transformers' save_pretrained."
                )
            return mesh.get_group()
    return current_group()


def refuse_local_slices(model: Any) -> None:
    """A model loaded with ``tp_rank``/``tp_size`` and no process group holds plain tensors that are slices: saving
    them as if they were full tensors would write a broken checkpoint. Compare with the shapes the config builds."""
    from ..plan.skeleton import build_on_meta

    reference = build_on_meta(type(model), copy.deepcopy(model.config), model.dtype, (), {}).state_dict()
    for name, t in model.state_dict().items():
        want = reference.get(name)
        if want is not None and tuple(want.shape) != tuple(t.shape):
            raise ValueError(
                f"{name} has shape {list(t.shape)} but {type(model).__name__} built from its config has "
                f"{list(want.shape)}: this model holds one rank's slices (loaded with tp_rank/tp_size and no process "
                "group), not full tensors. Load it with tp_plan='auto' under torchrun (DTensor parameters) to save it, "
                "or load it whole."
            )


def entries_of(model: Any, out_dtype: torch.dtype | None) -> list[Entry]:
    """The tensors transformers' ``save_pretrained`` would write, in state-dict order, tied ones once."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in keys_to_ignore_on_save(model):
        state.pop(key, None)
    # transformers' own choice of which tied name stays (it compares storages, never reads data)
    state = remove_tied_weights_from_state_dict(state, model)
    # transformers reverts its load-time key conversions (and orders keys naturally, which decides the shard
    # split); done on meta here: only names and order are needed, and a conversion that changes keys is refused
    from transformers.core_model_loading import revert_weight_conversion

    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in state.items()}
    reverted = revert_weight_conversion(model, meta)
    if set(reverted) != set(meta):
        raise NotImplementedError(
            f"{type(model).__name__} converts checkpoint keys on load (e.g. {sorted(set(reverted) ^ set(meta))[:2]}); "
            "reverting that needs several full tensors at once, which lowmem_hf.save_pretrained does not do. "
            "Use transformers' save_pretrained."
        )
    state = {k: state[k] for k in reverted}
    entries = []
    for name, t in state.items():
        if isinstance(t, DTensor) and not all(isinstance(p, (Shard, Replicate)) for p in t.placements):
            raise ValueError(
                f"{name} has placements {t.placements}: only Shard and Replicate tensors hold saved values "
                "(reduce a Partial tensor first)."
            )
        dt = out_dtype if out_dtype is not None and t.is_floating_point() else t.dtype
        if dt not in TAGS:
            raise ValueError(f"{name} is {dt}, which safetensors cannot store; pass dtype= a float dtype.")
        entries.append(Entry(name, t, dt))
    return entries


def as_shard(t: DTensor) -> DTensor:
    """``_StridedShard`` redistributed to the equivalent ``Shard`` (as transformers does before saving), so every
    rank's local tensor is one box of the global tensor."""
    placement = t.placements[0]
    if isinstance(placement, Shard) and type(placement) is not Shard:
        t = t.redistribute(placements=[Shard(placement.dim)])
    return t


def write_configs(staging: Staging, model: Any, entries: list[Entry]) -> None:
    """The config and generation config, by transformers' own ``save_pretrained``, into a folder of their own in
    ``staging`` (the switch moves them into place)."""
    if staging.failure is not None:
        return
    folder = staging.path("config")
    config = copy.deepcopy(model.config)
    floating = [e.dtype for e in entries if e.dtype.is_floating_point]
    written = floating[0] if floating else model.dtype
    config.dtype = str(written).split(".")[1]  # as transformers records it
    config.architectures = [type(model).__name__]
    steps = [("config.json", lambda: config.save_pretrained(folder))]
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        steps.append(("generation_config.json", lambda: model.generation_config.save_pretrained(folder)))
    for name, step in steps:
        try:
            step()
        except Exception as e:  # transformers' validation too: every rank must learn of it
            staging.fail(name, e, None)
            return
    staging.configs = sorted(os.listdir(folder))
