"""``LowMemAutoModel*``: drop-in ``AutoModel*.from_pretrained`` that streams weights into a meta-built model.

``from_pretrained`` validates its arguments into one ``LoadRequest`` (``request.py``) and runs the recipe
(``load.py``): ``prepare`` (resolve, build on meta, plan) then ``execute`` (fetch, stream, assign, finalize).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from transformers.models.auto import modeling_auto

from .arguments import from_pretrained_doc
from .compat.transformers_api import is_auto_class
from .load import load
from .request import make_request

__all__ = ["LowMemAutoModelBase", "AUTO_CLASSES"]


class LowMemAutoModelBase:
    """Base of every ``LowMemAutoModel*`` class; ``_auto_class`` is the transformers auto class it stands in for."""

    _auto_class: type = None  # type: ignore[assignment]

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(f"{type(self).__name__} is not instantiable; use {type(self).__name__}.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any, **kwargs: Any):
        # the docstring is written below from the one argument list (arguments.ARGUMENTS)
        return load(make_request(cls._auto_class, pretrained_model_name_or_path, *model_args, **kwargs))


# One signature, defined by make_request: shown by help() and IDEs, checked by make_request; the docs of its
# arguments from the same list as docs/arguments.md.
LowMemAutoModelBase.from_pretrained.__func__.__doc__ = from_pretrained_doc()
_signature = inspect.signature(make_request)
LowMemAutoModelBase.from_pretrained.__func__.__signature__ = _signature.replace(
    parameters=[inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + list(_signature.parameters.values())[1:]
)


def _make_auto_classes() -> dict[str, type]:
    """One ``LowMem<AutoClass>`` per transformers ``AutoModel*`` class, derived from transformers' auto module."""
    classes = {}
    for name, obj in vars(modeling_auto).items():
        if is_auto_class(obj) and name.startswith("AutoModel"):
            doc = (
                f"Drop-in for ``transformers.{name}``: ``from_pretrained`` streams the checkpoint into a meta-built "
                f"model at ~1.0x memory. See ``LowMemAutoModelBase.from_pretrained``."
            )
            classes[f"LowMem{name}"] = type(f"LowMem{name}", (LowMemAutoModelBase,), {"_auto_class": obj, "__doc__": doc, "__module__": __name__})
    return classes


AUTO_CLASSES: dict[str, type] = _make_auto_classes()
globals().update(AUTO_CLASSES)
__all__ += sorted(AUTO_CLASSES)
