"""lowmem_hf: load Hugging Face models at ~1.0x their size in memory.

``LowMemAutoModel*.from_pretrained`` is a drop-in for transformers' ``AutoModel*.from_pretrained``: it
builds the model on ``meta``, plans which bytes each parameter needs from the checkpoint headers, and
streams them submodule by submodule into memory of the final dtype, then finishes the model with
transformers' own tying and initialization.

``import lowmem_hf`` costs what ``import transformers`` costs plus the exceptions below: every other public
name is imported on first use (PEP 562), since torch and transformers' modeling code add ~270 MiB of peak RSS
to a process that may only want the CLI, the exceptions or the switch (``benchmarks/bench_import.py``).
"""

import importlib as _importlib
import pkgutil as _pkgutil

import transformers as _transformers  # a lazy module: its export table names every class without importing it

from .errors import (
    ArgumentTypeError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    CorruptDownloadError,
    HubConnectionError,
    IncompleteLoadError,
    ObjectStoreCredentialsError,
    ObjectStoreError,
    RemoteConnectionError,
    LowMemError,
    MissingKeyError,
    MissingShardError,
    NothingToLoadError,
    OutsideCheckpointError,
    OversizedModelError,
    UpstreamAPIError,
    RankFailedError,
    RemoteFileChangedError,
    ShapeMismatchError,
    UnsupportedArgumentError,
    UnsupportedConversionError,
)

__version__ = "0.1.0"

# One LowMem<AutoClass> per transformers AutoModel* class. The names come from transformers' export table, which
# lists them without importing modeling_auto (and torch; `transformers.models.auto.__all__` would cost 0.2 s more
# to build); auto.AUTO_CLASSES builds the classes from modeling_auto on first use, and tests/test_import_cost.py
# checks that both agree.
_AUTO_CLASS_NAMES = sorted("LowMem" + name for name in _transformers.__all__ if name.startswith("AutoModel"))

# Public name -> the submodule defining it, imported when the name is first read.
_LAZY: dict[str, str] = {
    "AUTO_CLASSES": "auto",
    "LowMemAutoModelBase": "auto",
    **dict.fromkeys(_AUTO_CLASS_NAMES, "auto"),
    "LoadRequest": "request",
    "make_request": "request",
    "PreparedLoad": "load",
    "prepare": "load",
    "execute": "load",
    "patch_transformers": "patch",
    "unpatch_transformers": "patch",
    "is_patched": "patch",
    "save_pretrained": "save",
    "LoadReport": "types",
    "DtypeDecision": "types",
    "fetch_small_files": "resolve_store",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later reads are plain attribute lookups
        return value
    # Submodules are attributes of the package (``lowmem_hf.plan``) without an import of their own, as for a package
    # that imports them eagerly.
    if name in {m.name for m in _pkgutil.iter_modules(__path__)}:
        return _importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "LowMemAutoModelBase",
    "LoadRequest",
    "PreparedLoad",
    "make_request",
    "prepare",
    "execute",
    "patch_transformers",
    "unpatch_transformers",
    "is_patched",
    "save_pretrained",
    "fetch_small_files",
    "LoadReport",
    "DtypeDecision",
    "LowMemError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "MissingShardError",
    "MissingKeyError",
    "ShapeMismatchError",
    "UnsupportedConversionError",
    "UnsupportedArgumentError",
    "ArgumentTypeError",
    "IncompleteLoadError",
    "NothingToLoadError",
    "RankFailedError",
    "RemoteFileChangedError",
    "OutsideCheckpointError",
    "CorruptDownloadError",
    "HubConnectionError",
    "RemoteConnectionError",
    "ObjectStoreError",
    "ObjectStoreCredentialsError",
    "OversizedModelError",
    "UpstreamAPIError",
    *_AUTO_CLASS_NAMES,
]
