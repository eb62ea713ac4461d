"""One rank of a transformers mesh (HSDP replicas x FSDP2 x TP), described and planned without a process group.

Under a group, a mesh rank's slices come from the DTensor placements transformers gives the meta model
(``mesh.specs_from_placements``). Without one, the same placements follow from the TP plan and FSDP2's rule:
``fully_shard`` shards every parameter on dim 0 over the ``fsdp`` mesh dim, as a strided shard where TP already
cut dim 0 (``split_factor`` = tp size), and HSDP replicas hold the same shards. Applying them with the same
``local_intervals`` arithmetic gives the rank's index sets, so the dry run of any rank of any mesh (64 ranks of a
405B model, one process) needs no group, and one rank's share can be loaded alone as plain tensors
(``device_mesh=MeshRank(...)``). ``tests/test_mesh_rank.py`` checks them against real gloo meshes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch.distributed.tensor import Replicate, Shard

from ..types import ShardSpec
from .mesh import local_intervals

__all__ = ["MeshRank", "mesh_rank_specs"]


@dataclass(frozen=True)
class MeshRank:
    """Rank ``rank`` of a ``dp_replicate_size x fsdp_size x tp_size`` mesh, laid out as transformers lays it out
    (row-major over ``(dp_replicate, fsdp, tp)``: the tp coordinate varies fastest).

    Example:
        ``LowMemAutoModelForCausalLM.from_pretrained(path, device_mesh=MeshRank(rank=9, tp_size=8, fsdp_size=8))``
        loads, in a process with no group, the slices rank 9 of a TP 8 x FSDP 8 job holds, as plain tensors.
    """

    rank: int
    """This rank, 0 .. ``world_size - 1``."""
    tp_size: int = 1
    fsdp_size: int = 1
    dp_replicate_size: int = 1

    def __post_init__(self):
        for name in ("rank", "tp_size", "fsdp_size", "dp_replicate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "rank" else 1):
                raise ValueError(f"MeshRank.{name} must be an int >= {0 if name == 'rank' else 1}, got {value!r}.")
        if self.rank >= self.world_size:
            raise ValueError(
                f"MeshRank(rank={self.rank}) is not a rank of a {self.dp_replicate_size} x {self.fsdp_size} x "
                f"{self.tp_size} mesh; ranks are 0..{self.world_size - 1}."
            )

    @property
    def world_size(self) -> int:
        return self.dp_replicate_size * self.fsdp_size * self.tp_size

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh's sizes along ``(dp_replicate, fsdp, tp)``."""
        return (self.dp_replicate_size, self.fsdp_size, self.tp_size)

    @property
    def coordinate(self) -> tuple[int, int, int]:
        """This rank's coordinate along ``(dp_replicate, fsdp, tp)``."""
        replica, rest = divmod(self.rank, self.fsdp_size * self.tp_size)
        fsdp, tp = divmod(rest, self.tp_size)
        return (replica, fsdp, tp)

    @property
    def tp_rank(self) -> int:
        return self.coordinate[2]


@dataclass(frozen=True)
class _StridedShard:
    """FSDP2's placement on a dim TP already sharded, as ``local_intervals`` reads it (``dim``, ``split_factor``)."""

    dim: int
    split_factor: int


def _placements(tp_spec: ShardSpec | None, mesh: MeshRank) -> tuple:
    """The placements FSDP2 and TP give a parameter on the ``(dp_replicate, fsdp, tp)`` mesh."""
    tp = Replicate() if tp_spec is None or mesh.tp_size == 1 else Shard(tp_spec.dim)
    if mesh.fsdp_size == 1 and mesh.dp_replicate_size == 1:
        fsdp = Replicate()  # TP alone: transformers applies no fully_shard
    elif isinstance(tp, Shard) and tp.dim == 0:
        fsdp = _StridedShard(0, mesh.tp_size)
    else:
        fsdp = Shard(0)
    return (Replicate(), fsdp, tp)


def mesh_rank_specs(
    shapes: Mapping[str, tuple[int, ...]], tp_specs: Mapping[str, ShardSpec], mesh: MeshRank
) -> dict[str, ShardSpec]:
    """This mesh rank's ``ShardSpec`` of every parameter it does not hold whole; pure arithmetic, no group.

    Args:
        shapes: every parameter's global shape, by name.
        tp_specs: the TP slices at this rank's tp coordinate (``plan.sharding.shard_specs``): which dim TP cuts.

    Raises:
        NotImplementedError: a TP slice that is not one cut of one dim (no TP style lowmem_hf knows makes one).
    """
    specs = {}
    for name, shape in shapes.items():
        tp_spec = tp_specs.get(name)
        if tp_spec is not None and (tp_spec.intervals is not None or tp_spec.flat):
            raise NotImplementedError(f"{name}: a TP slice of several runs ({tp_spec}) cannot be combined with FSDP here.")
        placements = _placements(tp_spec, mesh)
        intervals = local_intervals(shape, placements, mesh.shape, mesh.coordinate)
        local = tuple(sum(b - a for a, b in runs) for runs in intervals)
        if local == tuple(shape):
            continue
        dim = next(d for d, runs in enumerate(intervals) if runs != ((0, shape[d]),))
        runs = intervals[dim]
        style = tp_spec.style if tp_spec is not None else str(placements[1])
        specs[name] = ShardSpec(
            style, dim, runs[0][0] if runs else 0, runs[-1][1] if runs else 0, mesh.tp_rank, mesh.tp_size, intervals=intervals
        )
    return specs
