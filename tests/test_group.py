"""The group helpers: every rank agrees on a failure and raises the same named error; the engine a load gets."""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lowmem_hf.distributed import SingleDevice, engine_for
from lowmem_hf.distributed.group import Failure, agree, current_group, failure_error, from_rank_zero, is_rank_zero
from lowmem_hf.distributed.tp import TensorParallel, TPRequest
from lowmem_hf.errors import RankFailedError, RemoteFileChangedError


def test_the_error_names_every_failing_rank_and_is_the_first_ones_class():
    failed = [(1, Failure("a.safetensors changed", error=RemoteFileChangedError)), (3, Failure("timed out"))]
    error = failure_error(failed, context="cooperative fetch, wave 2")
    assert type(error) is RemoteFileChangedError
    assert str(error) == "cooperative fetch, wave 2: rank 1: a.safetensors changed; rank 3: timed out"


def test_an_os_error_failure_keeps_its_errno_and_the_subclass_it_picks():
    error = failure_error([(0, Failure("out is not writable", error=OSError, errno=errno.EACCES))], context="save", grouped=False)
    assert type(error) is PermissionError and error.errno == errno.EACCES
    assert error.strerror == "save: out is not writable"


def test_without_a_group_agree_raises_this_ranks_failure_from_its_cause():
    assert current_group() is None and is_rank_zero() and from_rank_zero("mine") == "mine"
    agree(None, None, context="nothing failed")
    cause = ValueError("boom")
    with pytest.raises(RankFailedError, match=r"^writing: ValueError: boom$") as e:
        agree(Failure("ValueError: boom"), None, context="writing", cause=cause)
    assert e.value.__cause__ is cause


def test_the_failure_and_the_error_cross_processes():
    failure = Failure("disk full", error=OSError, errno=errno.ENOSPC)
    assert pickle.loads(pickle.dumps(failure)) == failure
    error = pickle.loads(pickle.dumps(failure_error([(2, Failure("gone"))], context="wave 0")))
    assert type(error) is RankFailedError and str(error) == "wave 0: rank 2: gone"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agree_worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        group = current_group()
        found = {"rank_zero": is_rank_zero(), "from_rank_zero": from_rank_zero(f"rank {rank}", group)}
        agree(None, group, context="nobody fails")
        failure = Failure("No space left", error=OSError, errno=errno.ENOSPC) if rank == 1 else None
        try:
            agree(failure, group, context="write the checkpoint")
        except OSError as e:
            found["error"] = [type(e).__name__, e.errno, str(e)]
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(found, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_raises_the_same_error_when_one_rank_fails(tmp_path):
    mp.spawn(_agree_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [f["rank_zero"] for f in found] == [True, False]
    assert [f["from_rank_zero"] for f in found] == ["rank 0", "rank 0"]
    expected = ["OSError", errno.ENOSPC, f"[Errno {errno.ENOSPC}] write the checkpoint: rank 1: No space left"]
    assert [f["error"] for f in found] == [expected, expected]


def test_a_load_without_tp_or_zero3_gets_the_single_device_engine_and_tp_the_tp_one():
    engine = engine_for(None)
    assert type(engine) is SingleDevice and engine.tp is None and engine.rank == 0 and not engine.in_place
    assert engine.notes() == [] and engine.destination(torch.nn.Linear(1, 1)) is None
    tp = TPRequest(plan="auto", tp_size=2, tp_rank=1, distributed=False)
    engine = engine_for(tp)
    assert type(engine) is TensorParallel and engine.tp is tp and engine.rank == 1
    assert "rank 1 of 2's slices" in engine.notes()[0]
