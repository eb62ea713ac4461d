"""The one-line switch: route transformers' own ``from_pretrained`` calls through lowmem_hf.

    import lowmem_hf
    lowmem_hf.patch_transformers()          # or: with lowmem_hf.patch_transformers(): ...
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)   # loaded by lowmem_hf

Unchanged scripts get the same through ``lowmem-hf run SCRIPT ARGS`` (``runner.py``). Patching transformers
is the product here (STYLE.md, convention 7), so it is explicit, reversible and tested: the originals are kept
as they were found on the classes and ``unpatch_transformers()`` puts exactly those objects back.

What is patched: ``from_pretrained`` of the auto classes' base class and of every ``AutoModel*`` class (transformers
gives each auto class its own copy of the method) and
``PreTrainedModel.from_pretrained`` (every concrete model class, including subclasses a user wrote, unless
they override ``from_pretrained`` without calling ``super()``). A call lowmem_hf cannot honour (an argument it
does not implement, such as ``quantization_config`` or ``device_map="auto"``, or a quantized checkpoint) goes to
transformers' own loader, with one warning naming the argument: behaviour never changes silently. So does a call
the direct API refuses on purpose where transformers loads (a checkpoint none of whose tensors fits the model:
transformers returns it fully initialized, every key reported missing).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

from .errors import FallbackWarning, NothingToLoadError, UnsupportedArgumentError

__all__ = ["patch_transformers", "unpatch_transformers", "is_patched", "FallbackWarning"]

_originals: dict[type, Any] = {}
# Set while a call is inside lowmem_hf or inside transformers' loader on a fallback: transformers' auto classes
# call the concrete class's from_pretrained, which must then go straight to transformers' own code.
_active = threading.local()


class _Patch:
    """Returned by ``patch_transformers()``; as a context manager it undoes the patch on exit."""

    def __enter__(self) -> "_Patch":
        return self

    def __exit__(self, *exc_info) -> None:
        unpatch_transformers()


def patch_transformers() -> _Patch:
    """Route every ``AutoModel*.from_pretrained`` and ``PreTrainedModel.from_pretrained`` through lowmem_hf.

    Idempotent. Works as a plain call or as a context manager (``with patch_transformers(): ...``).

    Returns:
        A handle whose ``__exit__`` calls ``unpatch_transformers()``.

    Example:
        >>> with lowmem_hf.patch_transformers():
        ...     model = AutoModelForCausalLM.from_pretrained("./my-llama", dtype=torch.bfloat16)
    """
    if not _originals:
        from .arguments import transformers_defaults

        transformers_defaults()  # read from transformers' own from_pretrained, before it is replaced
        for cls in _classes_to_patch():
            _originals[cls] = cls.__dict__["from_pretrained"]
            cls.from_pretrained = classmethod(_switched_from_pretrained)
    return _Patch()


def _classes_to_patch() -> list[type]:
    """``PreTrainedModel`` and every auto class that carries its own ``from_pretrained``."""
    # Imported here, not at the top: ``import lowmem_hf`` stays as cheap as ``import transformers`` (see
    # lowmem_hf/__init__.py), and is_patched / unpatch_transformers need none of transformers' modeling code.
    import transformers.models.auto.modeling_auto  # noqa: F401  (creates the AutoModel* classes the switch patches)
    from transformers import PreTrainedModel

    from .compat.transformers_api import auto_model_base

    found, todo = [PreTrainedModel, auto_model_base()], [auto_model_base()]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if "from_pretrained" in sub.__dict__:
                found.append(sub)
    return found


def unpatch_transformers() -> None:
    """Put transformers' original ``from_pretrained`` methods back (a no-op when not patched)."""
    for cls, original in _originals.items():
        cls.from_pretrained = original
    _originals.clear()


def is_patched() -> bool:
    """Whether ``patch_transformers()`` is in effect."""
    return bool(_originals)


def _original_for(cls: type) -> Any:
    """transformers' own method for ``cls``: the nearest patched class in its MRO."""
    owner = next(c for c in cls.__mro__ if c in _originals)
    return _originals[owner].__get__(None, cls)


def _switched_from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
    if getattr(_active, "depth", 0):
        return _original_for(cls)(pretrained_model_name_or_path, *model_args, **kwargs)
    _active.depth = 1
    try:
        return _load_or_fall_back(cls, pretrained_model_name_or_path, model_args, kwargs)
    finally:
        _active.depth = 0


def _load_or_fall_back(cls, path, model_args: tuple, kwargs: dict):
    from .compat.transformers_api import TELEMETRY_KWARGS
    from .load import execute, prepare  # on the first switched call; transformers' modeling code is loaded by then
    from .request import make_request
    from .resolve_store import is_store_url

    # transformers' own callers add these; they change nothing about what is loaded, so the switch drops them
    ours = {k: v for k, v in kwargs.items() if k not in TELEMETRY_KWARGS}
    try:
        prepared = prepare(make_request(cls, path, *model_args, **ours))
    except UnsupportedArgumentError as unsupported:
        if is_store_url(path):
            raise UnsupportedArgumentError(
                unsupported.argument, f"{unsupported} transformers' own from_pretrained cannot load {path} (an "
                "object-store URL), so the switch has no loader to hand this call to: copy the checkpoint to a local "
                "folder to load it with transformers.",
            ) from unsupported
        reason = f"uses {unsupported.argument!r}, which lowmem_hf does not implement ({unsupported})"
        return _fall_back(cls, path, model_args, kwargs, reason)
    except NothingToLoadError as nothing:
        # The direct API refuses a checkpoint none of whose tensors fits (almost always a wrong path or class);
        # transformers returns a fully initialized model and reports every key missing, and its own tests and
        # scripts rely on that. With nothing to read, lowmem_hf would save nothing: its loader gives the same model.
        reason = f"loads none of the checkpoint's tensors ({nothing})"
        return _fall_back(cls, path, model_args, kwargs, reason)
    model, report = execute(prepared)  # logs the load (logs.log_load)
    if not prepared.request.output_loading_info:
        return model
    return model, report.to_dict()  # transformers' contract: LoadStateDictInfo.to_dict()


def _fall_back(cls, path, model_args: tuple, kwargs: dict, reason: str):
    """transformers' own ``from_pretrained`` for the call, after one ``FallbackWarning`` saying why."""
    warnings.warn(
        f"lowmem_hf: {cls.__name__}.from_pretrained({str(path)!r}) {reason}; loading with transformers' own "
        "from_pretrained instead.",
        FallbackWarning,
        stacklevel=5,
    )
    return _original_for(cls)(path, *model_args, **kwargs)
