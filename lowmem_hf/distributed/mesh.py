"""Meshes beyond 1-D tensor parallelism: transformers' ``DistributedConfig`` (TP, FSDP2, HSDP replicas).

transformers builds the mesh (``prepare_distribute_model``) and shards the meta model
(``maybe_distribute_model``: TP, then FSDP2 ``fully_shard``); lowmem_hf calls exactly those, so the model,
its placements, FSDP2 wrapping and attributes are what ``transformers.from_pretrained(distributed_config=...)``
returns. What lowmem_hf adds is the read: each parameter's local index set comes from its DTensor's placements
and this rank's mesh coordinate (``local_intervals``), so whatever transformers places is what is read, and only
that. There is no table of styles here.

FSDP2 shards unevenly when a dimension does not divide (``torch.chunk`` semantics: the last ranks hold less,
possibly nothing, and FSDP2 pads internally); lowmem_hf reads exactly those shorter shards, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.distributed import DistributedConfig

from ..compat.torch_api import strided_split_factor
from ..compat.transformers_api import parameter_plan
from ..errors import UnsupportedArgumentError
from ..types import ShardSpec
from .group import current_group, world_size

__all__ = [
    "MeshSetup", "check_distributed_config", "set_up_mesh", "local_intervals", "strided_shard_indices", "specs_from_placements",
]

# The dense mesh transformers builds, outermost first (``initialize_distributed_mesh``).
_DENSE_DIMS = ("pp", "dp_replicate", "fsdp", "tp")
_SIZE_OF_DIM = {"dp_replicate": "dp_replicate_size", "fsdp": "fsdp_size", "tp": "tp_size"}


@dataclass(frozen=True)
class MeshSetup:
    """transformers' mesh for one ``DistributedConfig``, set up on this process."""

    config: Any
    """The resolved ``DistributedConfig`` (sizes filled in)."""
    mesh_manager: Any
    """transformers' ``TransformersDeviceMesh`` (dense and expert views of the same ranks)."""
    tp_rank: int
    """This process's coordinate on the ``tp`` mesh dimension."""


def check_distributed_config(value: Any) -> DistributedConfig | None:
    """Validate ``distributed_config`` without any process group: type, and the parallelisms lowmem_hf implements.

    Raises:
        UnsupportedArgumentError: ``pp_size`` or ``ep_size`` above 1 (names the size).
        TypeError: neither a ``DistributedConfig`` nor a dict of its fields.
    """
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = DistributedConfig.from_dict(dict(value))
    if not isinstance(value, DistributedConfig):
        raise TypeError(f"distributed_config must be a transformers DistributedConfig (or a dict of its fields), got {type(value).__name__}.")
    for name in ("pp_size", "ep_size"):
        size = getattr(value, name)
        if size is not None and size > 1:
            raise UnsupportedArgumentError(
                "distributed_config",
                f"DistributedConfig({name}={size}) is not supported by lowmem_hf (pipeline and expert parallelism); "
                f"use tp_size, fsdp_size and dp_replicate_size, or load with transformers.",
            )
    return value


def _describe(config: DistributedConfig) -> str:
    return f"DistributedConfig(dp_replicate_size={config.dp_replicate_size}, fsdp_size={config.fsdp_size}, tp_size={config.tp_size})"


def _sizes_of_mesh(device_mesh: Any) -> dict[str, int]:
    """``{size field: size}`` of an n-D mesh whose dims are named from transformers' (dp_replicate, fsdp, tp)."""
    names = tuple(device_mesh.mesh_dim_names or ())
    if device_mesh.ndim == 1 and not names:
        names = ("tp",)
    known = [n for n in _DENSE_DIMS if n in names]
    if len(names) != device_mesh.ndim or set(names) - set(_SIZE_OF_DIM) or list(names) != known:
        raise ValueError(
            f"device_mesh has dims {names or '(unnamed)'}; lowmem_hf takes a mesh whose dims are named from "
            f"{_DENSE_DIMS[1:]} in that order (as transformers builds it), e.g. init_device_mesh('cpu', (2, 2), "
            "mesh_dim_names=('fsdp', 'tp'))."
        )
    return {_SIZE_OF_DIM[n]: int(device_mesh.size(i)) for i, n in enumerate(names)}


def _manager_from_mesh(device_mesh: Any, config: DistributedConfig) -> Any:
    """transformers' mesh manager over the caller's ranks, in the caller's order (same layout as transformers')."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.utils import TransformersDeviceMesh

    ranks = device_mesh.mesh
    dense = DeviceMesh(
        device_mesh.device_type,
        ranks.reshape(1, config.dp_replicate_size, config.fsdp_size, config.tp_size),
        mesh_dim_names=_DENSE_DIMS,
    )
    expert = DeviceMesh(
        device_mesh.device_type,
        ranks.reshape(1, config.dp_replicate_size, config.efsdp_size, config.ep_size),
        mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"),
    )
    return TransformersDeviceMesh(dense, expert)


def set_up_mesh(
    model_class: type, *, distributed_config: DistributedConfig | None, tp_plan: Any, tp_size: int | None, device_mesh: Any
) -> MeshSetup | None:
    """Check the sizes against the world, then set up transformers' mesh. ``None``: every size is 1.

    Under torchrun with no process group yet, transformers' ``prepare_distribute_model`` initializes one,
    exactly as ``from_pretrained(distributed_config=...)`` does.

    Raises:
        ValueError: sizes whose product is not the world size, a mesh whose size or dims disagree with the
            config or the world, ``tp_plan``/``tp_size`` next to ``distributed_config`` (transformers refuses it too).
    """
    if distributed_config is not None and (tp_plan is not None or tp_size is not None):
        raise ValueError(
            "Pass either distributed_config or the standalone tp_plan/tp_size arguments, not both; set "
            "DistributedConfig(tp_size=..., tp_plan=...) instead (transformers refuses both too)."
        )
    world = world_size()
    if world is None:
        raise ValueError(
            "distributed_config and an n-D device_mesh need a process group: run under torchrun (or call "
            "torch.distributed.init_process_group first)."
        )
    if device_mesh is not None:
        sizes = _sizes_of_mesh(device_mesh)
        if device_mesh.size() != world:
            raise ValueError(
                f"device_mesh has {device_mesh.size()} ranks but the world has {world}; pass a mesh over every rank."
            )
        if distributed_config is None:
            distributed_config = DistributedConfig(**sizes)
        for name, size in sizes.items():
            if getattr(distributed_config, name) != size:
                raise ValueError(
                    f"device_mesh has {name.removesuffix('_size')}={size} but distributed_config has {name}="
                    f"{getattr(distributed_config, name)}; make them agree (or pass only one of them)."
                )
    config = distributed_config
    product = config.dp_replicate_size * config.fsdp_size * config.tp_size
    if product != world:
        raise ValueError(
            f"{_describe(config)} needs dp_replicate_size * fsdp_size * tp_size = {product} ranks, but the world "
            f"has {world}; choose sizes whose product is {world}."
        )
    if product == 1:
        return None
    if device_mesh is not None:
        if current_group() is None:
            raise ValueError("device_mesh given but no process group is initialized; create the mesh after init_process_group.")
        mesh_manager = _manager_from_mesh(device_mesh, config)
    else:
        config, _, mesh_manager = model_class.prepare_distribute_model(config)
    return MeshSetup(config=config, mesh_manager=mesh_manager, tp_rank=int(mesh_manager.get_mesh("tp").get_local_rank()))


def local_intervals(
    shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """This mesh coordinate's index set of every tensor dim, as sorted ``(start, stop)`` runs.

    Applies the placements left to right as DTensor does (torch's ``compute_local_shape_and_global_offset``), each
    ``Shard`` (torch's public ``Shard.local_shard_size_and_offset``) or strided shard (``strided_shard_positions``)
    selecting a subset of the indices the previous mesh dims left; ``Replicate`` keeps all. A strided shard (TP and
    FSDP sharding the same dim) gives several runs. Row-major order of the indices is the local tensor's order.

    Raises:
        NotImplementedError: a ``Partial`` placement (never produced for parameters).
    """
    runs: list[list[tuple[int, int]]] = [[(0, n)] if n else [] for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        split_factor = strided_split_factor(placement)
        if split_factor is None and not isinstance(placement, Shard):
            raise NotImplementedError(f"placement {placement} on mesh dim {mesh_dim} cannot be read from a checkpoint slice")
        dim = placement.dim % len(shape)
        length = sum(b - a for a, b in runs[dim])
        if split_factor is not None:
            positions = strided_shard_positions(length, split_factor, mesh_shape[mesh_dim], coordinate[mesh_dim])
        else:
            size, offset = Shard.local_shard_size_and_offset(length, mesh_shape[mesh_dim], coordinate[mesh_dim])
            positions = [(offset, offset + size)]
        runs[dim] = [run for start, stop in positions for run in _take(runs[dim], start, stop)]
    return tuple(_merged(r) for r in runs)


def _take(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of the indices ``runs`` list, in order, as runs: O(runs), not O(indices), so a
    405B model's 53248-row dims cost as little to plan as a small model's."""
    taken, position = [], 0
    for a, b in runs:
        lo, hi = max(start, position), min(stop, position + b - a)
        if lo < hi:
            taken.append((a + lo - position, a + hi - position))
        position += b - a
    return taken


def _merged(runs: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1][1] = b
        elif b > a:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def strided_shard_positions(size: int, split_factor: int, num_chunks: int, rank: int) -> list[tuple[int, int]]:
    """The positions of a dim of ``size`` that a strided shard gives mesh coordinate ``rank`` of ``num_chunks``, as
    ``(start, stop)`` runs (one per piece, so a 405B model's 53248-row dims cost O(pieces), not O(rows)).

    torch's right-to-left sharding (``_StridedShard``): the dim is cut into ``split_factor`` pieces (the shards an
    inner mesh dim, TP, already made), each piece into ``num_chunks``, and ``rank`` takes its chunk of every piece.
    Both cuts are ``torch.chunk``'s: pieces of ``ceil(n / parts)``, the last ones shorter or empty. Computed here
    because the method torch offers for it is private and changed signature between releases (torch 2.13 added an
    offset-mode argument 2.11 lacks); tests/test_mesh.py checks it against torch's own where one is installed.
    """
    positions = []
    piece = -(-size // split_factor)
    for p in range(split_factor):
        start, stop = min(piece * p, size), min(piece * (p + 1), size)
        chunk = -(-(stop - start) // num_chunks)
        lo, hi = start + min(chunk * rank, stop - start), start + min(chunk * (rank + 1), stop - start)
        if lo < hi:
            positions.append((lo, hi))
    return positions


def strided_shard_indices(size: int, split_factor: int, num_chunks: int, rank: int) -> list[int]:
    """``strided_shard_positions`` as the list of indices (torch's own form of the answer, which the tests compare)."""
    return [i for start, stop in strided_shard_positions(size, split_factor, num_chunks, rank) for i in range(start, stop)]


def specs_from_placements(model: torch.nn.Module, tp_plan: Mapping[str, str] | None = None) -> dict[str, ShardSpec]:
    """This rank's ``ShardSpec`` of every DTensor parameter that is not whole on this rank, from its placements.

    ``style`` is the parameter's TP style where ``tp_plan`` (transformers' wildcard plan) gives one, else the
    placements (e.g. ``(Replicate(), Shard(dim=0))``). Checked against the meta DTensor's own local shape.

    Raises:
        ValueError: a dim the ``tp`` mesh dim does not divide (transformers' TP forward needs equal shards).
        RuntimeError: the derived local shape differs from the DTensor's (a lowmem_hf bug: nothing is read then).
    """
    tp_plan = tp_plan or {}
    specs = {}
    for name, param in model.named_parameters():
        tensor = param.data if isinstance(param.data, DTensor) else param
        if not isinstance(tensor, DTensor):
            continue
        mesh, placements, shape = tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape)
        coordinate = mesh.get_coordinate()
        names = tuple(mesh.mesh_dim_names or ())
        tp = names.index("tp") if "tp" in names else None
        if tp is not None and isinstance(placements[tp], Shard) and shape[placements[tp].dim % len(shape)] % mesh.shape[tp]:
            d = placements[tp].dim % len(shape)
            raise ValueError(
                f"{name} has {shape[d]} along dimension {d} (shape {list(shape)}), which tp_size={mesh.shape[tp]} does "
                f"not divide; choose a tp_size that divides {shape[d]}."
            )
        intervals = local_intervals(shape, placements, tuple(mesh.shape), coordinate)
        local = tuple(sum(b - a for a, b in runs) for runs in intervals)
        if local != tuple(tensor.to_local().shape):
            raise RuntimeError(
                f"{name}: placements {placements} on mesh {tuple(mesh.shape)} at {coordinate} give local shape "
                f"{list(tensor.to_local().shape)}, lowmem_hf derived {list(local)}. This is a lowmem_hf bug; please report it."
            )
        if local == shape:
            continue  # replicated on every mesh dim: read whole
        dim = next(d for d, runs in enumerate(intervals) if runs != ((0, shape[d]),))
        runs = intervals[dim]
        tp_size, tp_rank = (int(mesh.shape[tp]), int(coordinate[tp])) if tp is not None else (1, 0)
        style = (parameter_plan(name, tp_plan) if tp is not None else None) or str(placements)
        specs[name] = ShardSpec(
            style, dim, runs[0][0] if runs else 0, runs[-1][1] if runs else 0, tp_rank, tp_size, intervals=intervals
        )
    return specs
