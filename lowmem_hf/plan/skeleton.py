"""Build the model on ``meta`` exactly as transformers' ``from_pretrained`` does, allocating nothing."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from transformers.monkey_patching import patch_output_recorders

__all__ = ["build_on_meta"]


def build_on_meta(model_class: type, config: Any, dtype: torch.dtype, model_args: tuple, model_kwargs: dict[str, Any]):
    """Instantiate ``model_class(config, *model_args, **model_kwargs)`` on ``meta`` under transformers' own init context.

    transformers' ``get_init_context`` sets the default dtype to ``dtype`` (so modules that hard-code
    another dtype keep it, exactly as in a real load), switches tying off and puts every tensor on
    ``meta``; ``patch_output_recorders`` is the one post-construction step ``from_pretrained`` applies
    to every instance.
    """
    contexts = model_class.get_init_context(dtype, False, False, None)
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        model = model_class(config, *model_args, **model_kwargs)
        patch_output_recorders(model)
    return model
