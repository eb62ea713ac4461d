"""Every rank of a save learns whether any rank failed, and all raise the same error: no rank goes on into a
collective alone, so none hangs waiting for a rank that gave up."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Failure", "agree"]


@dataclass(frozen=True)
class Failure:
    """Why one rank could not do its part of a save; sent to every rank by ``agree``."""

    errno: int | None
    """The OS error number (``errno.ENOSPC``...), or ``None`` for an error that is not an ``OSError``."""
    text: str
    """What failed, naming the file, with the bytes needed where known."""


def agree(failure: Failure | None, group, *, what: str, outcome: str, cause: BaseException | None = None) -> None:
    """Every rank learns whether any rank failed, and raises if so: no rank goes on into a collective alone.

    The error is an ``OSError`` with the first failing rank's ``errno`` (``PermissionError`` for ``EACCES``...);
    ``cause`` (this rank's own exception, if any) is chained to it.
    """
    failures = [failure]
    if group is not None:
        failures = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, failure, group=group)
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        text = "; ".join(f"rank {r}: {f.text}" for r, f in failed) if group is not None else failed[0][1].text
        message = f"lowmem_hf.save_pretrained could not {what}, {outcome}: {text}"
        code = failed[0][1].errno
        raise (OSError(code, message) if code is not None else OSError(message)) from cause
