"""Distributed loads: the group helpers (``group``) and the engines that place a model's parameters.

- ``engine``: what an engine is (``Engine``) and the single-device default;
- ``tp``: tensor parallelism, and meshes beyond it, through transformers' own engine (``mesh``: the mesh set-up
  and what each rank holds of a DTensor; ``mesh_rank``: one rank of a mesh planned or loaded with no group);
- ``zero3``: DeepSpeed ZeRO-3 partitions.

``engine_for`` picks one engine per load, from the table ``ENGINES``: a new engine is a module and a row there.
"""

from __future__ import annotations

from typing import Any

from .engine import Engine, SingleDevice
from .mesh import local_intervals, strided_shard_indices
from .mesh_rank import MeshRank
from .tp import TensorParallel
from .zero3 import ZeroStage3

__all__ = ["ENGINES", "Engine", "MeshRank", "SingleDevice", "engine_for", "local_intervals", "strided_shard_indices"]

ENGINES = (ZeroStage3, TensorParallel)
"""The engines in the order they are asked; the first whose ``claim`` returns one loads the model. ZeRO-3 comes
first: it is transformers' own test, and it refuses a TP request itself (``ZeroStage3.check_servable``)."""


def engine_for(tp: Any) -> Engine:
    """The engine for this load: the first of ``ENGINES`` to claim it, else ``SingleDevice``.

    Args:
        tp: the validated tensor-parallel request (``tp.request_tp``), or None. It is made first, before this is
            called, since under torchrun it creates the process group that the revision pinning uses.

    Raises:
        ValueError, UnsupportedArgumentError: what an engine's own test refuses (``zero3.zero3_enabled``).
    """
    for engine in ENGINES:
        claimed = engine.claim(tp)
        if claimed is not None:
            return claimed
    return SingleDevice()
