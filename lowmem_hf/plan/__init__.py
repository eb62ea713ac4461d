"""Plan: the meta skeleton, checkpoint-key mapping, dtype policy, and what each submodule reads."""

from .dtypes import DTYPE_POLICIES, DtypePolicy, parse_dtype
from .keys import KeyMapping, map_checkpoint_keys
from .planner import make_plan, submodule_of
from .skeleton import build_on_meta

__all__ = [
    "DTYPE_POLICIES",
    "DtypePolicy",
    "parse_dtype",
    "KeyMapping",
    "map_checkpoint_keys",
    "make_plan",
    "submodule_of",
    "build_on_meta",
]
