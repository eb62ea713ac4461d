"""The ``lowmem_hf`` logger: it speaks when transformers would, so one verbosity setting governs both.

- Level: transformers' verbosity (``transformers.logging.set_verbosity_*``, ``TRANSFORMERS_VERBOSITY``), read
  at each record, so a script that quiets transformers quiets lowmem_hf too. ``show_info()`` lowers it to INFO
  for this process (``lowmem-hf run`` does, so the log says who loaded the model).
- Output, library use: records propagate to the application's logging as usual. Only when the application
  configured none (the root logger has no handler) does lowmem_hf print them on stderr itself, as transformers
  does with its own handler; otherwise Python would drop info lines and print warnings without a name.
- Output under ``lowmem-hf run`` (``keep_on_stderr()``): the records are the runner's, not the script's, so they
  go to stderr as ``[lowmem_hf] ...`` and nowhere else, whatever logging the script sets up: a script that
  sends the root logger to stdout in its own format (transformers' run_clm.py does) neither reformats nor
  duplicates them, and a ``dictConfig`` that disables existing loggers does not silence them.
- Per load, on rank 0 only: one info line, and one warning when keys are missing, unexpected or mismatched
  (transformers' own load report, which lowmem_hf's finishing step also logs, goes to transformers' logger).
"""

from __future__ import annotations

import logging
import sys

from transformers.utils import logging as hf_logging

from .distributed.group import is_rank_zero

__all__ = ["logger", "show_info", "keep_on_stderr", "log_load"]

logger = logging.getLogger("lowmem_hf")
_floor: int | None = None
_stderr_only = False  # set by keep_on_stderr()


class _FollowTransformers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        level = hf_logging.get_verbosity()
        if _floor is not None:
            level = min(level, _floor)
        return record.levelno >= level


class _Stderr(logging.StreamHandler):
    """``[lowmem_hf] ...`` on the current ``sys.stderr``: under ``keep_on_stderr()`` always, otherwise only when the
    application set up no logging of its own."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("[lowmem_hf] %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not _stderr_only and logging.getLogger().handlers:
            return  # the record propagates to the application's handlers
        self.stream = sys.stderr  # the current one: pytest's capture, a runner's redirection
        super().emit(record)


if not any(isinstance(f, _FollowTransformers) for f in logger.filters):
    logger.setLevel(logging.DEBUG)  # the filter decides, so transformers' verbosity can change at any time
    logger.addFilter(_FollowTransformers())
    logger.addHandler(_Stderr())


def show_info() -> None:
    """Show lowmem_hf's info lines in this process whatever transformers' verbosity."""
    global _floor
    _floor = logging.INFO


def keep_on_stderr() -> None:
    """From now on print lowmem_hf's records on stderr as ``[lowmem_hf] ...``, and only there (``lowmem-hf run``).

    The script under the runner configures logging for its own records; lowmem_hf's are not its own, so they
    neither propagate to its handlers (which would print them again, in its format, wherever it logs) nor
    depend on them.
    """
    global _stderr_only
    _stderr_only = True
    logger.propagate = False


def _names(keys, limit: int = 5) -> str:
    # mismatched keys are (name, checkpoint shape, model shape), as in transformers' LoadStateDictInfo
    keys = sorted(k if isinstance(k, str) else f"{k[0]}: checkpoint {tuple(k[1])}, model {tuple(k[2])}" for k in keys)
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def log_load(model_class: str, path: str, report) -> None:
    """One info line for a finished load and, where keys did not match, one warning (rank 0 only)."""
    if not is_rank_zero():
        return
    if _stderr_only:
        # dictConfig(disable_existing_loggers=True), the default, disables every logger the script's config does
        # not name; the script cannot name ours (run plainly, it has no lowmem_hf), so that is not its choice
        logger.disabled = False
    logger.info(
        "lowmem_hf loaded %s from %s: %s, %.1f MiB read, %.1f MiB of parameters, %.2f s",
        model_class, path, report.dtype, report.bytes_read / 2**20, report.model_bytes / 2**20, report.wall_seconds,
    )
    parts = [
        f"{len(keys)} {what} ({_names(keys)})"
        for what, keys in (
            ("missing keys, newly initialized", report.missing_keys),
            ("unexpected keys, not loaded", report.unexpected_keys),
            ("mismatched keys, newly initialized", report.mismatched_keys),
        )
        if keys
    ]
    if parts:
        logger.warning("%s from %s: %s.", model_class, path, "; ".join(parts))
