"""Build the model on ``meta`` exactly as transformers' ``from_pretrained`` does, allocating nothing."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook
from transformers.monkey_patching import patch_output_recorders

from ..errors import OversizedModelError

__all__ = ["build_on_meta"]


def build_on_meta(
    model_class: type, config: Any, dtype: torch.dtype, model_args: tuple, model_kwargs: dict[str, Any],
    *, max_numel: int | None = None, describe: Callable[[int], str] = str,
):
    """Instantiate ``model_class(config, *model_args, **model_kwargs)`` on ``meta`` under transformers' own init context.

    ``max_numel``: refuse (``OversizedModelError``, message ``describe(numel so far)``) as soon as the parameters
    built pass this many elements. A config value off by orders of magnitude (``num_hidden_layers=10**12``) would
    otherwise build modules for minutes or hours: meta tensors cost no memory, but each module is a Python object.

    transformers' ``get_init_context`` sets the default dtype to ``dtype`` (so modules that hard-code
    another dtype keep it, exactly as in a real load), switches tying off and puts every tensor on
    ``meta``; ``patch_output_recorders`` is the one post-construction step ``from_pretrained`` applies
    to every instance.
    """
    contexts = model_class.get_init_context(dtype, False, False, None)
    with ExitStack() as stack:
        stack.enter_context(_bounded(max_numel, describe))
        for context in contexts:
            stack.enter_context(context)
        model = model_class(config, *model_args, **model_kwargs)
        patch_output_recorders(model)
    return model


@contextmanager
def _bounded(max_numel: int | None, describe: Callable[[int], str]) -> Iterator[None]:
    """Count the elements of every parameter registered meanwhile (torch's global registration hook: no module of
    the model needs to cooperate) and raise once they pass ``max_numel``."""
    if max_numel is None:
        yield
        return
    built = 0

    def count(module: torch.nn.Module, name: str, param: torch.Tensor | None) -> None:
        nonlocal built
        if param is not None:
            built += param.numel()
            if built > max_numel:
                raise OversizedModelError(describe(built))

    handle = register_module_parameter_registration_hook(count)
    try:
        yield
    finally:
        handle.remove()
