"""Tensor parallelism at load time: who this rank is, which plan applies, and transformers' TP engine.

Two modes:

- **distributed** (a process group is initialized, a ``device_mesh`` is given, or the process runs under
  torchrun with ``tp_plan`` set): the model is sharded by transformers' own machinery
  (``prepare_distribute_model`` + ``maybe_distribute_model``), giving meta DTensors with transformers'
  placements and its TP forward; lowmem_hf then fills each local shard from its slice of the checkpoint.
  Under torchrun with no group yet, ``prepare_distribute_model`` initializes one exactly as
  ``transformers.from_pretrained(tp_plan=...)`` does; lowmem_hf never initializes one otherwise.
- **local** (``tp_rank`` and ``tp_size`` given, no process group): rank ``tp_rank``'s slices are loaded
  as plain tensors, with no TP forward; ``LoadReport.shards`` says how each parameter is sliced. A
  ``device_mesh=MeshRank(...)`` (``mesh_rank.py``) does the same for one rank of a TP x FSDP2 x HSDP mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from transformers.distributed import DistributedConfig

from ..compat.transformers_api import resolve_parallel_plans
from ..plan.sharding import check_head_divisibility, shard_specs
from ..settings import local_rank
from ..types import ShardSpec
from .engine import Engine
from .group import current_group, world_size
from .mesh import set_up_mesh, specs_from_placements
from .mesh_rank import MeshRank, mesh_rank_specs

__all__ = ["TPRequest", "request_tp", "rank_device", "plan_shards", "distribute", "TensorParallel"]


@dataclass(frozen=True)
class TPRequest:
    """A validated tensor-parallel request."""

    plan: Any
    """``"auto"`` or a dict of overriding rules."""
    tp_size: int
    tp_rank: int
    distributed: bool
    """True: DTensors on a mesh with transformers' TP forward. False: plain local slices."""
    distributed_config: Any = None
    mesh_manager: Any = None
    mesh_rank: MeshRank | None = None
    """Without a group: the one rank of a mesh whose shards are loaded (``device_mesh=MeshRank(...)``)."""


def request_tp(
    model_class: type, *, tp_plan: Any, tp_size: int | None, tp_rank: int | None, device_mesh: Any, distributed_config: Any = None
) -> TPRequest | None:
    """Validate the TP arguments and, in distributed mode, set up transformers' mesh. ``None``: no TP.

    A ``distributed_config`` or an n-D ``device_mesh`` goes to ``mesh.set_up_mesh`` (TP x FSDP2 x HSDP).

    Raises:
        ValueError: ``tp_rank >= tp_size``, a mesh whose size disagrees with ``tp_size``, a bad ``tp_plan``,
            or TP asked for with neither a process group nor ``tp_rank``/``tp_size``.
    """
    if tp_plan is None and tp_size is None and tp_rank is None and device_mesh is None and distributed_config is None:
        return None
    if isinstance(device_mesh, MeshRank):
        return _request_mesh_rank(tp_plan, tp_size, tp_rank, device_mesh, distributed_config)
    if distributed_config is not None or (device_mesh is not None and device_mesh.ndim > 1):
        return _request_on_mesh(model_class, tp_plan, tp_size, tp_rank, device_mesh, distributed_config)
    plan = "auto" if tp_plan is None else tp_plan
    if plan != "auto" and not isinstance(plan, Mapping):
        raise ValueError(f"tp_plan must be 'auto' or a dict {{module_pattern: style}}, got {tp_plan!r}.")
    for name, value in (("tp_size", tp_size), ("tp_rank", tp_rank)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}.")
    if tp_size is not None and tp_size < 1:
        raise ValueError(f"tp_size must be at least 1, got {tp_size}.")
    if tp_rank is not None and tp_size is not None and tp_rank >= tp_size:
        raise ValueError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}; ranks are 0..{tp_size - 1}.")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise NotImplementedError(f"device_mesh has {device_mesh.ndim} dimensions; lowmem_hf takes a 1-D tp mesh.")
        if tp_size is not None and tp_size != device_mesh.size():
            raise ValueError(f"device_mesh has {device_mesh.size()} ranks but tp_size={tp_size}; pass one or make them agree.")
        tp_size = device_mesh.size()

    distributed = current_group() is not None or device_mesh is not None or (world_size() is not None and tp_rank is None)
    if not distributed:
        if tp_size is None or tp_rank is None:
            raise ValueError(
                "Tensor parallelism needs either an initialized process group (run under torchrun) or explicit "
                f"tp_rank and tp_size to load one rank's slices without one; got tp_rank={tp_rank}, tp_size={tp_size}."
            )
        return TPRequest(plan=plan, tp_size=tp_size, tp_rank=tp_rank, distributed=False)

    world = world_size()
    tp_size = world if tp_size is None else tp_size
    if tp_size != world:
        raise NotImplementedError(
            f"tp_size={tp_size} on a world of {world} ranks: transformers' TP mesh spans every rank, so "
            "tensor parallelism over a subset of ranks is not supported. Pass tp_size=world size."
        )
    if tp_size == 1:
        return None  # one rank holds everything: transformers builds no mesh for it either
    config = DistributedConfig(tp_size=tp_size, tp_plan=dict(plan) if isinstance(plan, Mapping) else plan)
    # transformers' own mesh set-up: under torchrun it initializes the process group like from_pretrained does.
    config, _, mesh_manager = model_class.prepare_distribute_model(config)
    rank = mesh_manager.get_mesh("tp").get_local_rank()
    if tp_rank is not None and tp_rank != rank:
        raise ValueError(f"tp_rank={tp_rank} but this process is rank {rank} of the tp mesh; omit tp_rank under a process group.")
    return TPRequest(plan=plan, tp_size=tp_size, tp_rank=rank, distributed=True, distributed_config=config, mesh_manager=mesh_manager)


def rank_device(tp: TPRequest | None, requested: torch.device) -> torch.device:
    """The device this rank's shards go to: on an accelerator mesh, the accelerator at ``LOCAL_RANK``.

    transformers binds each rank of its mesh to that accelerator (``_bind_local_device``) and loads the model there,
    whatever the ambient device (``tp_plan`` and ``device_map`` are mutually exclusive in ``from_pretrained``); the
    DTensors' local shards must live on the mesh's device type. So an ambient CPU device becomes the rank's
    accelerator, as there; an explicit other accelerator is an error rather than a model split across devices.
    """
    if tp is None or tp.mesh_manager is None:
        return requested
    kind = tp.mesh_manager.get_mesh("tp").device_type
    if kind == "cpu":
        return requested
    bound = torch.device(kind, local_rank())
    if requested.type == "cpu":
        return bound
    if requested.type != bound.type or (requested.index is not None and requested.index != bound.index):
        raise ValueError(
            f"device={requested} but this rank's mesh is on {bound} (LOCAL_RANK={bound.index}, a {kind} mesh): every "
            f"rank loads onto its own {kind} device, as transformers' tp_plan does; drop device/device_map."
        )
    return bound


def _request_on_mesh(
    model_class: type, tp_plan: Any, tp_size: int | None, tp_rank: int | None, device_mesh: Any, distributed_config: Any
) -> TPRequest | None:
    """``request_tp`` for a ``distributed_config`` or an n-D ``device_mesh``: transformers' mesh over every rank."""
    setup = set_up_mesh(model_class, distributed_config=distributed_config, tp_plan=tp_plan, tp_size=tp_size, device_mesh=device_mesh)
    if setup is None:
        return None
    if tp_rank is not None and tp_rank != setup.tp_rank:
        raise ValueError(f"tp_rank={tp_rank} but this process is rank {setup.tp_rank} of the tp mesh; omit tp_rank under a process group.")
    plan = setup.config.tp_plan if setup.config.tp_plan is not None else "auto"
    return TPRequest(
        plan=plan, tp_size=setup.config.tp_size, tp_rank=setup.tp_rank, distributed=True,
        distributed_config=setup.config, mesh_manager=setup.mesh_manager,
    )


def _request_mesh_rank(tp_plan: Any, tp_size: Any, tp_rank: Any, mesh: MeshRank, distributed_config: Any) -> TPRequest:
    """One rank of a mesh, alone: no group may exist, and the TP arguments, if given, must agree with the mesh."""
    if current_group() is not None:
        raise ValueError(
            f"device_mesh={mesh} describes one rank for a process with no group, but a group is initialized; pass "
            "distributed_config (or a DeviceMesh) and let each rank load its own shards."
        )
    for name, given, wanted in (("tp_size", tp_size, mesh.tp_size), ("tp_rank", tp_rank, mesh.tp_rank)):
        if given is not None and given != wanted:
            raise ValueError(f"{name}={given} but device_mesh={mesh} has {name} {wanted}; pass only the MeshRank.")
    if distributed_config is not None:
        raise ValueError(f"device_mesh={mesh} already gives the mesh's sizes; drop distributed_config.")
    plan = "auto" if tp_plan is None else tp_plan
    return TPRequest(plan=plan, tp_size=mesh.tp_size, tp_rank=mesh.tp_rank, distributed=False, mesh_rank=mesh)


def plan_shards(model: Any, request: TPRequest) -> tuple[dict[str, ShardSpec], dict[str, str]]:
    """This rank's slice of every sharded parameter, from transformers' resolved plan; validated, no I/O.

    Returns:
        ``(specs, resolved_plan)``.
    """
    config = request.distributed_config or DistributedConfig(
        tp_size=request.tp_size, tp_plan=dict(request.plan) if isinstance(request.plan, Mapping) else request.plan
    )
    resolved = resolve_parallel_plans(model, config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    specs = shard_specs(shapes, resolved, tp_rank=request.tp_rank, tp_size=request.tp_size)
    check_head_divisibility(model.config, specs, request.tp_size)
    return specs, resolved


def distribute(model_class: type, model: Any, request: TPRequest) -> tuple[Any, dict[str, ShardSpec]]:
    """Shard the meta model with transformers' engine (TP, then FSDP2); each rank's slices from the placements.

    Returns:
        ``(model, specs)``: the model with meta DTensor parameters, and this rank's ``ShardSpec`` of every
        parameter it does not hold whole (derived from the DTensor placements and this rank's mesh coordinate).

    Raises:
        ValueError: a TP-sharded dim or the attention heads that tp_size does not divide (before any byte is read).
    """
    model = model_class.maybe_distribute_model(model, request.distributed_config, request.mesh_manager)
    specs = specs_from_placements(model, model.tp_plan if request.tp_size > 1 else None)
    check_head_divisibility(model.config, {n: s for n, s in specs.items() if s.tp_size > 1}, request.tp_size)
    return model, specs


class TensorParallel(Engine):
    """Tensor parallelism, and meshes beyond it (TP x FSDP2 x HSDP): the skeleton sharded by transformers' engine
    into meta DTensors (distributed), or this rank's slices as plain tensors (``tp_rank``/``tp_size``, no group)."""

    def __init__(self, tp: TPRequest):
        self.tp = tp

    @classmethod
    def claim(cls, tp: TPRequest | None) -> TensorParallel | None:
        """The engine for a load with a TP request; None without one."""
        return cls(tp) if tp is not None else None

    @property
    def rank(self) -> int:
        return self.tp.mesh_rank.rank if self.tp.mesh_rank is not None else self.tp.tp_rank

    def shard(self, model_class: type, model: Any) -> tuple[Any, dict[str, ShardSpec]]:
        if self.tp.distributed:
            return distribute(model_class, model, self.tp)
        shards, _ = plan_shards(model, self.tp)
        if self.tp.mesh_rank is not None:
            shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
            shards = mesh_rank_specs(shapes, shards, self.tp.mesh_rank)
        return model, shards

    def notes(self) -> list[str]:
        if self.tp.distributed:
            return []
        if self.tp.mesh_rank is not None:
            return [
                f"Loaded only the shards rank {self.tp.mesh_rank.rank} of a {self.tp.mesh_rank} mesh holds, as plain "
                "tensors (no process group): no TP forward and no FSDP2 wrapping; LoadReport.shards says how each "
                "parameter is sliced."
            ]
        return [
            f"Loaded only rank {self.tp.tp_rank} of {self.tp.tp_size}'s slices as plain tensors (no process "
            "group): the model's forward is NOT tensor-parallel and will fail or be wrong until a TP engine "
            "wraps these shards; LoadReport.shards says how each parameter is sliced."
        ]
