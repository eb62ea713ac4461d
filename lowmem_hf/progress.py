"""One progress bar over the bytes a load reads (for ``fetch="ranges"`` Hub loads: the bytes it fetches).

Drawn on local rank 0 only (one bar per node, not one per rank), and never where the user switched progress
bars off: ``HF_HUB_DISABLE_PROGRESS_BARS=1`` or huggingface_hub's ``disable_progress_bars()`` (both seen by
``are_progress_bars_disabled()``), or transformers' ``logging.disable_progress_bar()``. ``tqdm_class`` is
transformers' argument: any tqdm-compatible class. Downloads of whole files (``fetch="files"``) get
huggingface_hub's own bars with the same class.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.utils import are_progress_bars_disabled
from transformers.utils import logging as hf_logging

from .settings import local_rank

__all__ = ["progress_enabled", "byte_bar"]


def progress_enabled() -> bool:
    """Whether this process may draw a bar: local rank 0, and no library switch turned bars off."""
    if local_rank() != 0:
        return False
    return not are_progress_bars_disabled() and hf_logging.is_progress_bar_enabled()


def byte_bar(total: int, *, desc: str, tqdm_class: Any = None):
    """A tqdm bar over ``total`` bytes, or ``None`` where progress is off (see the module doc)."""
    if not progress_enabled() or total <= 0:
        return None
    if tqdm_class is None:
        from tqdm.auto import tqdm as tqdm_class
    return tqdm_class(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
