"""DeepSpeed ZeRO-3 at load time: every rank reads only the bytes of its own partition of each parameter.

Under ZeRO-3 (an ``HfDeepSpeedConfig`` of stage 3 alive, as ``TrainingArguments(deepspeed=...)`` makes one),
transformers builds the model under ``deepspeed.zero.Init``: each parameter is an empty placeholder whose
``ds_tensor`` holds this rank's partition, the contiguous range ``[rank * n, rank * n + n)`` of the flattened
tensor, padded at the end of the last rank. transformers then reads the whole checkpoint on rank 0 and, submodule
by submodule, gathers the full parameters on every rank, copies the values in on rank 0 and re-partitions
(a broadcast of the whole model). lowmem_hf builds the same skeleton (transformers' own init context), then reads
into each ``ds_tensor`` exactly the elements it holds: for a contiguous stored tensor, one byte range per
parameter per rank. The partition arithmetic is DeepSpeed's, read off each parameter at load time
(``partition_numel()``, ``ds_numel``, the rank in ``ds_process_group``), so nothing here copies its constants.

Every source serves partitions: a range of the flattened tensor is one byte range of a stored tensor (local files,
the Hub's ``fetch="ranges"``), or the runs of the stored DCP chunks it spans (``runs.flat_box_runs``).

Buffers are not partitioned: every rank reads them whole (transformers broadcasts rank 0's). What is missing from
the checkpoint is initialized by transformers' own finishing step, which gathers it under ZeRO-3.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import replace
from typing import Any, Callable, ContextManager, Mapping

import torch

from ..compat.deepspeed_api import partition_without_broadcast
from ..errors import UnsupportedArgumentError
from ..types import DtypeDecision, LoadPlan, ShardSpec, SubmodulePlan, TensorRead
from .engine import Engine

__all__ = ["zero3_enabled", "partition_specs", "check_servable", "retarget", "destination", "held", "ZeroStage3"]

STYLE = "zero3"


def zero3_enabled() -> bool:
    """transformers' own test: an ``HfDeepSpeedConfig`` of stage 3 is alive (the Trainer creates it).

    Raises:
        ValueError: the load runs inside ``deepspeed.zero.Init`` with no such config (Lightning's ``configure_model``,
            or a bare ``with deepspeed.zero.Init(...)``): neither transformers nor lowmem_hf would see ZeRO-3, and
            the model would come out unpartitioned with buffers left uninitialized.
        UnsupportedArgumentError: ZeRO-3 with DeepSpeed AutoTP (``tensor_parallel.autotp_size > 1``): DeepSpeed
            slices the gathered weights when its engine starts, so a partition read here is not what it keeps; the
            switch hands the load to transformers (its ZeRO-3 path, which refuses only key conversions under AutoTP).
    """
    from transformers.integrations import deepspeed_config, is_deepspeed_zero3_enabled

    enabled = is_deepspeed_zero3_enabled()
    if not enabled and _inside_zero_init():
        raise ValueError(
            "from_pretrained runs inside deepspeed.zero.Init, but no HfDeepSpeedConfig is alive, so ZeRO-3 is not "
            "enabled for transformers' loading code. Create one from the same DeepSpeed config and keep a reference "
            "while loading (as the HF Trainer does): `keep = transformers.integrations.HfDeepSpeedConfig(ds_config)`; "
            "under Lightning, `HfDeepSpeedConfig(self.trainer.strategy.config)` in configure_model."
        )
    if enabled and (deepspeed_config() or {}).get("tensor_parallel", {}).get("autotp_size", 1) > 1:
        raise UnsupportedArgumentError(
            "deepspeed",
            "ZeRO-3 with DeepSpeed AutoTP (tensor_parallel.autotp_size > 1) is not read into partitions by lowmem_hf "
            "(DeepSpeed re-slices the weights when its engine starts); load with transformers' from_pretrained.",
        )
    return enabled


def _inside_zero_init() -> bool:
    """Whether a ``deepspeed.zero.Init`` context is active (only if DeepSpeed is imported: nothing to ask otherwise)."""
    module = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return module is not None and getattr(module, "zero_init_context", 0) > 0


def _partitioned(t: Any) -> bool:
    return getattr(t, "ds_tensor", None) is not None and hasattr(t, "ds_numel")


def partition_specs(model: torch.nn.Module) -> dict[str, ShardSpec]:
    """Each partitioned parameter's flat element range on this rank, from DeepSpeed's arithmetic on the parameter.

    Raises:
        UnsupportedArgumentError: a partition layout lowmem_hf does not read into (hpZ secondary partitions, NVMe
            offload); the switch then hands the load to transformers.
    """
    import torch.distributed as dist

    specs = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if not _partitioned(param):
            continue
        if getattr(param, "ds_secondary_tensor", None) is not None or getattr(param.ds_tensor, "final_location", None) is not None:
            raise UnsupportedArgumentError(
                "deepspeed",
                f"{name}: ZeRO-3 with hierarchical (hpZ) partitions or NVMe offload is not read by lowmem_hf; "
                "load with transformers' from_pretrained (the switch does so by itself).",
            )
        group = param.ds_process_group
        size = param.partition_numel()  # DeepSpeed: aligned numel // partition world size
        rank = dist.get_rank(group=group)
        start = min(rank * size, param.ds_numel)
        stop = min(start + size, param.ds_numel)
        specs[name] = ShardSpec(
            style=STYLE, dim=0, start=start, stop=stop, tp_rank=rank, tp_size=dist.get_world_size(group=group), flat=True
        )
    return specs


def check_servable(*, converted: Mapping[str, Any], tp_requested: bool, mmap: bool) -> None:
    """Refuse, before any read, what lowmem_hf cannot read into ZeRO-3 partitions (the switch then falls back).

    Sharded training checkpoints (DCP) are served: a partition is a range of the flattened tensor, which the DCP
    reader cuts out of whatever chunks the checkpoint stores (``flat_box_runs``)."""
    why = None
    if tp_requested:
        why = "tensor parallelism (tp_plan, tp_size, device_mesh, distributed_config) together with ZeRO-3"
    elif mmap:
        why = "mmap=True (a partition is DeepSpeed's memory, never a view of a file)"
    elif converted:
        why = f"keys transformers converts (e.g. into {sorted(converted)[:2]}): a converted tensor has no byte range per partition"
    if why is not None:
        raise UnsupportedArgumentError(
            "deepspeed", f"lowmem_hf does not load {why}; load with transformers' from_pretrained (the switch does so by itself)."
        )


def retarget(plan: LoadPlan, model: torch.nn.Module) -> LoadPlan:
    """Give every read into a partition the partition's dtype: transformers copies the checkpoint values into the
    gathered parameter, whose dtype DeepSpeed chose (its ``bf16``/``fp16`` config), whatever the dtype policy says."""
    def fix(sub: SubmodulePlan) -> SubmodulePlan:
        reads = []
        for r in sub.reads:
            if r.shard is not None and r.shard.style == STYLE:
                dtype = model.get_parameter(r.target).ds_tensor.dtype
                if r.decision.dtype != dtype:
                    r = replace(r, decision=DtypeDecision(dtype, "zero3_partition"))
            reads.append(r)
        return replace(sub, reads=tuple(reads))

    return replace(plan, submodules=tuple(fix(s) for s in plan.submodules))


def destination(model: torch.nn.Module, read: TensorRead) -> torch.Tensor | None:
    """Where a read lands: the valid part of the parameter's partition (filled in place; the last rank's padding
    stays as DeepSpeed left it), or None (a fresh tensor: buffers)."""
    if read.shard is None or read.shard.style != STYLE:
        return None
    return model.get_parameter(read.target).ds_tensor.view(-1).narrow(0, 0, read.shard.stop - read.shard.start)


def held(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory this rank holds for ``t``: its partition under ZeRO-3, else ``t`` itself."""
    return t.ds_tensor if _partitioned(t) else t


class ZeroStage3(Engine):
    """DeepSpeed ZeRO-3: the skeleton built as partitioned placeholders, each read filling this rank's partition."""

    in_place = True
    names_config_errors = False  # deepspeed.zero.Init's own errors while building pass as they are, as in transformers

    def __init__(self, *, tp_requested: bool):
        self.tp_requested = tp_requested
        """Whether tensor parallelism was asked for too, which ``check_servable`` refuses."""

    @classmethod
    def claim(cls, tp: Any) -> ZeroStage3 | None:
        """The engine when ZeRO-3 is enabled (``zero3_enabled``, which may refuse the load), whatever ``tp`` says;
        None otherwise."""
        return cls(tp_requested=tp is not None) if zero3_enabled() else None

    def build_context(self) -> ContextManager[Any]:
        # transformers builds under deepspeed.zero.Init by itself; this only spares the broadcast of values the
        # load overwrites anyway
        return partition_without_broadcast()

    def shard(self, model_class: type, model: Any) -> tuple[Any, dict[str, ShardSpec]]:
        return model, partition_specs(model)

    def check_servable(self, request: Any, mapping: Any) -> None:
        check_servable(converted=mapping.converted, tp_requested=self.tp_requested, mmap=request.mmap)

    def retarget(self, plan: LoadPlan, model: torch.nn.Module) -> LoadPlan:
        return retarget(plan, model)

    def destination(self, model: torch.nn.Module) -> Callable[[TensorRead], torch.Tensor | None]:
        return functools.partial(destination, model)
