"""What an engine is: how a load places the model's parameters, told to the recipe in a few calls.

``load.prepare`` and ``load.execute`` call these, in this order, on the one engine ``engine_for`` picked:

    with engine.build_context():                        # build the skeleton on meta
        model = ...
    model, shards = engine.shard(model_class, model)    # this rank's slice of each parameter
    engine.check_servable(request, mapping)             # refuse what the engine cannot read into, before any I/O
    plan = engine.retarget(make_plan(...), model)       # the engine's last word on the plan
    stream(..., into=engine.destination(model))         # where each read lands
    assign_submodule(..., in_place=engine.in_place)   # (and build's names_config_errors)
    notes += engine.notes()                             # what the report must say about the result

``SingleDevice`` is the default: every parameter whole, in fresh tensors. A new engine is a subclass in a module
of its own, named in the table ``engine_for`` asks (``ENGINES``, whose ``claim`` each engine answers).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager

import torch

from ..types import LoadPlan, ShardSpec, TensorRead

__all__ = ["Engine", "SingleDevice"]


class Engine:
    """The base of every engine; each method's default is the single-device behaviour."""

    tp: Any = None
    """The validated tensor-parallel request (``TPRequest``) the model is sharded by; None without TP."""
    in_place: bool = False
    """Whether a read fills the parameter's own memory (``destination``), so assigning must keep the parameter."""
    names_config_errors: bool = True
    """Whether an error raised while the skeleton is built is blamed on the config value it names (``build``);
    False where the build context raises errors of its own that no config value explains."""

    @classmethod
    def claim(cls, tp: Any) -> Engine | None:
        """This engine for the load, or None when the load is not this engine's (``engine_for`` asks each engine of
        its table in turn). ``tp``: the validated tensor-parallel request, or None."""
        return None

    @property
    def rank(self) -> int:
        """This rank's coordinate in the slices it reads, for the dry run's estimate (0 unsharded)."""
        return 0

    def build_context(self) -> ContextManager[Any]:
        """The context the skeleton is built in."""
        return contextlib.nullcontext()

    def shard(self, model_class: type, model: Any) -> tuple[Any, dict[str, ShardSpec]]:
        """The skeleton as the engine places it, and this rank's ``ShardSpec`` of each parameter it does not hold
        whole (none: every parameter whole)."""
        return model, {}

    def check_servable(self, request: Any, mapping: Any) -> None:
        """Refuse, before any byte is read, a ``LoadRequest`` or a key ``mapping`` the engine cannot load."""

    def retarget(self, plan: LoadPlan, model: torch.nn.Module) -> LoadPlan:
        """The plan with what the engine decides over the dtype policy (unchanged by default)."""
        return plan

    def destination(self, model: torch.nn.Module) -> Callable[[TensorRead], torch.Tensor | None] | None:
        """The stream's ``into``: where each read lands, or None for fresh tensors everywhere."""
        return None

    def notes(self) -> list[str]:
        """What the load report must say about the model this engine leaves."""
        return []


class SingleDevice(Engine):
    """Every parameter whole on this process, in fresh tensors: the default."""
