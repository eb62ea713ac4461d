"""A save's side of ``distributed.group.agree``: every rank learns whether any rank failed, and all raise the same
``OSError``, so no rank goes on into a collective alone and none hangs waiting for a rank that gave up."""

from __future__ import annotations

from typing import Any

from ..distributed.group import Failure, agree as agree_in_group

__all__ = ["Failure", "os_failure", "agree"]


def os_failure(errno: int | None, text: str) -> Failure:
    """One rank's failed part of a save: an ``OSError`` with ``errno`` (``errno.ENOSPC``...; None for an error
    that is not an ``OSError``) and ``text`` naming the file, with the bytes needed where known."""
    return Failure(text, error=OSError, errno=errno)


def agree(failure: Failure | None, group: Any, *, what: str, outcome: str, cause: BaseException | None = None) -> None:
    """Every rank learns whether any rank failed, and raises if so: ``OSError("lowmem_hf.save_pretrained could not
    <what>, <outcome>: rank N: <text>; ...")`` with the first failing rank's ``errno`` (``PermissionError`` for
    ``EACCES``...), ``cause`` (this rank's own exception, if any) chained to it."""
    agree_in_group(failure, group, context=f"lowmem_hf.save_pretrained could not {what}, {outcome}", cause=cause)
