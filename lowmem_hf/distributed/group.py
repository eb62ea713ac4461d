"""The process group as lowmem_hf sees it: which group there is, who is rank 0, and how the ranks agree on failure.

lowmem_hf never initializes a group itself (transformers' mesh set-up may, under torchrun, as its own
``from_pretrained`` does). A caller that has a group of its own (a mesh's) passes it; everything else uses the
default group, when there is one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch.distributed as dist

from ..errors import RankFailedError
from ..settings import launcher_rank, launcher_world_size

__all__ = ["current_group", "world_size", "is_rank_zero", "from_rank_zero", "Failure", "agree", "failure_error"]


def current_group() -> Any:
    """The default process group when one is initialized, else None (one process, or before the launcher's
    script created its group)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def world_size() -> int | None:
    """The ranks of the job: the default group's size, or torchrun's ``WORLD_SIZE`` before a group exists; None
    in one process outside a launcher."""
    return dist.get_world_size() if current_group() is not None else launcher_world_size()


def is_rank_zero() -> bool:
    """Rank 0 of the process group, or of torchrun's ``RANK`` before a group exists; True in one process. The
    one test for side effects a job does once (log lines)."""
    if current_group() is not None:
        return dist.get_rank() == 0
    return launcher_rank() in (None, 0)


def from_rank_zero(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every rank of ``group`` (one broadcast of a picklable object); ``value`` itself
    without a group. For decisions rank 0 makes for all (a pinned commit), where the other ranks' own outcomes do
    not count: an outcome every rank must share is ``agree``'s."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


@dataclass(frozen=True)
class Failure:
    """Why one rank could not do its part; what ``agree`` sends to every rank. Plain data, so it pickles whatever
    the exception behind it was."""

    text: str
    """What failed on that rank, naming the file or the peer (the rank itself is added by ``failure_error``)."""
    error: type[BaseException] = RankFailedError
    """The class every rank raises when this is the first failing rank's failure; importable, since the class
    crosses ranks by name."""
    errno: int | None = None
    """For an ``OSError`` class: the OS error number (``errno.ENOSPC``...), given as ``error(errno, message)`` so
    that ``OSError`` picks its subclass (``PermissionError`` for ``EACCES``) and sets ``.errno``."""


def failure_error(failed: Sequence[tuple[int, Failure]], *, context: str, grouped: bool = True) -> BaseException:
    """The one error every rank raises for the same failures, built alike on every rank.

    Args:
        failed: ``(rank, Failure)`` of every rank that failed, in rank order (not empty).
        context: what the ranks were doing, the message's first part (``"cooperative fetch, wave 3"``).
        grouped: whether there are ranks to name; False: the message is the one failure's text.

    Returns:
        ``failed[0]``'s ``error`` class, with the message ``"{context}: rank 0: <text>; rank 2: <text>"`` (every
        failing rank; ``"{context}: <text>"`` without a group) and, for an ``OSError``, the first failing rank's
        ``errno``.
    """
    first = failed[0][1]
    text = "; ".join(f"rank {r}: {f.text}" for r, f in failed) if grouped else first.text
    message = f"{context}: {text}"
    if first.errno is not None and issubclass(first.error, OSError):
        return first.error(first.errno, message)
    return first.error(message)


def agree(failure: Failure | None, group: Any, *, context: str, cause: BaseException | None = None) -> None:
    """Every rank learns whether any rank failed, and if one did every rank raises the same error: no rank goes on
    into a later collective alone, and none hangs waiting for one that gave up.

    Every rank of ``group`` must call it at the same point, failed or not. It sends this rank's ``failure``
    (``None``: this rank's part went well) to every rank, one ``all_gather_object``; without a group (``None``:
    one process) nothing is sent and only this rank's failure counts.

    Args:
        failure: this rank's failure, or None.
        group: the process group whose ranks take part, or None.
        context: what the ranks were doing, the start of the error message.
        cause: this rank's own exception, if any. It does not travel (it may not pickle, and it is this rank's
            alone): its text does, in ``failure.text``; here it is chained to the error this rank raises.

    Raises:
        The first failing rank's ``Failure.error`` (``RankFailedError`` by default; ``OSError`` with its ``errno``
        for a save), on every rank, with the message ``failure_error`` builds from every failing rank's text,
        ``from cause``.

    Example (a save, where one rank's disk is full)::

        failure = Failure(f"writing {path}: {e.strerror}", error=OSError, errno=e.errno) if e is not None else None
        agree(failure, group, context="lowmem_hf.save_pretrained could not write the checkpoint", cause=e)
        # every rank: OSError(ENOSPC, "lowmem_hf.save_pretrained could not write the checkpoint: rank 1: writing ...")
    """
    failures = [failure]
    if group is not None:
        failures = [None] * dist.get_world_size(group)
        dist.all_gather_object(failures, failure, group=group)
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        raise failure_error(failed, context=context, grouped=group is not None) from cause
