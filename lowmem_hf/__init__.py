"""lowmem_hf: load Hugging Face models at ~1.0x their size in memory.

``LowMemAutoModel*.from_pretrained`` is a drop-in for transformers' ``AutoModel*.from_pretrained``: it
builds the model on ``meta``, plans which bytes each parameter needs from the checkpoint headers, and
streams them submodule by submodule into memory of the final dtype, then finishes the model with
transformers' own tying and initialization.
"""

from .auto import AUTO_CLASSES, LowMemAutoModelBase
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteLoadError,
    LowMemError,
    MissingKeyError,
    MissingShardError,
    RankFailedError,
    ShapeMismatchError,
    UnsupportedArgumentError,
    UnsupportedConversionError,
)
from .fetch import RemoteFileChangedError
from .load import PreparedLoad, execute, prepare
from .patch import is_patched, patch_transformers, unpatch_transformers
from .request import LoadRequest, make_request
from .save import save_pretrained
from .types import DtypeDecision, LoadReport

globals().update(AUTO_CLASSES)

# Named explicitly for readers and IDEs; every other LowMemAutoModelFor* comes from AUTO_CLASSES.
LowMemAutoModel = AUTO_CLASSES["LowMemAutoModel"]
LowMemAutoModelForCausalLM = AUTO_CLASSES["LowMemAutoModelForCausalLM"]
LowMemAutoModelForSequenceClassification = AUTO_CLASSES["LowMemAutoModelForSequenceClassification"]
LowMemAutoModelForSeq2SeqLM = AUTO_CLASSES["LowMemAutoModelForSeq2SeqLM"]

__version__ = "0.1.0"

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
    "IncompleteLoadError",
    "RankFailedError",
    "RemoteFileChangedError",
    *sorted(AUTO_CLASSES),
]
