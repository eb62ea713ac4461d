"""The cooperative fetch's status rounds (``exchange.py``): after each wave, and once more at the end, every rank
posts whether it succeeded and waits for every other rank's.

The process group's store carries the statuses because a store wait has a timeout and tells which key (rank) is
missing, where a gloo receive from a dead peer only fails, or hangs until the group's timeout.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from ..compat.torch_api import default_store, store_values
from ..distributed.group import Failure, failure_error, from_rank_zero
from ..errors import RankFailedError, RemoteFileChangedError

__all__ = ["WaveStatuses"]


class WaveStatuses:
    """Each rank's status per round (one per wave, then a closing one), posted to the process group's store (see
    the module doc: a store wait has a timeout and names the missing rank, where a gloo receive from a dead peer
    fails or hangs). So not ``group.agree``, whose ``all_gather_object`` has neither; the error every rank raises
    for the statuses is the one ``agree`` would raise (``group.failure_error``)."""

    def __init__(self, *, timeout_s: float):
        self._rank, self._world = dist.get_rank(), dist.get_world_size()
        self._store = default_store()
        self._timeout_s = timeout_s
        # this load's store keys, unique per load: rank 0's clock
        self._tag = from_rank_zero(f"lowmem_hf/exchange/{time.time_ns()}", dist.group.WORLD)

    def report_failure(self, index: int, why: str) -> list[int]:
        """Post ``why`` as this rank's status of round ``index`` (the round the live ranks reach next) and return
        the ranks that post none within the timeout (a dead or hung rank never does)."""
        key = f"{self._tag}/{index}/"
        self._store.set(key + str(self._rank), "error:" + why)
        try:
            self._store.wait([key + str(r) for r in range(self._world)], timedelta(seconds=self._timeout_s))
            return []
        except Exception:  # noqa: BLE001 - a timeout is the answer
            return [r for r in range(self._world) if not self._store.check([key + str(r)])]

    def agree(self, index: int, status: str, *, what: str | None = None) -> None:
        """Post this rank's status of round ``index`` (``what``: its name in errors, default ``wave <index>``) and
        wait for every rank's; fail everywhere if one failed."""
        what = what or f"wave {index}"
        key = f"{self._tag}/{index}/"
        self._store.set(key + str(self._rank), status)
        keys = [key + str(r) for r in range(self._world)]
        try:
            self._store.wait(keys, timedelta(seconds=self._timeout_s))
        except Exception as error:  # noqa: BLE001 - the store raises a bare RuntimeError/DistStoreError on timeout
            missing = [r for r in range(self._world) if not self._store.check([key + str(r)])]
            raise RankFailedError(
                f"cooperative fetch, {what}: rank(s) {missing} posted no status within {self._timeout_s:.0f} s "
                f"(died or hung); the load is aborted on every rank. ({error})"
            ) from error
        statuses = {r: value.decode() for r, value in enumerate(store_values(self._store, keys))}
        failed = [(r, _failure(s)) for r, s in sorted(statuses.items()) if s != "ok"]
        if failed:
            raise failure_error(failed, context=f"cooperative fetch, {what}")


def _failure(status: str) -> Failure:
    """The ``Failure`` a rank's posted status stands for: a changed file is ``RemoteFileChangedError`` on every rank."""
    if status.startswith("changed:"):
        return Failure(status.removeprefix("changed:"), error=RemoteFileChangedError)
    return Failure(status.removeprefix("error:"))
