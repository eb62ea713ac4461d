"""DeepSpeed names that are private. Checked against DeepSpeed 0.19.8 (pinned) and the newest release CI installs."""

from __future__ import annotations

import contextlib
from typing import Iterator

__all__ = ["partition_without_broadcast"]


@contextlib.contextmanager
def partition_without_broadcast() -> Iterator[None]:
    """While the skeleton is built under ``deepspeed.zero.Init``: partition each new parameter without first
    broadcasting rank 0's values to every rank.

    DeepSpeed's ``Init._zero_init_param`` creates every parameter at full size on every rank and broadcasts rank 0's
    values before cutting the partition, so that all ranks start from the same weights. Under transformers' load
    those values are uninitialized memory (``no_init_weights``), and lowmem_hf overwrites every loaded partition;
    what the checkpoint lacks is initialized by transformers' finishing step, which gathers it and takes rank 0's
    values. The broadcast therefore carries nothing, yet it moves the whole model to every rank (on the 2 GB Llama,
    1.6 of a 2.2 s load at 2 ranks, 3.1 of 3.4 s at 4) and leaves the freed full tensors resident in the receiving
    ranks' heaps (1.4-2.8x their partition bytes; ``benchmarks/bench_zero3.py``). Replacing that private method is
    the only way to skip it: convert + partition instead, for the duration of the block only. Where a DeepSpeed
    release lacks either method, the block runs DeepSpeed's own unchanged (correct, only slower): the broadcast
    values are overwritten by the load anyway.
    """
    from deepspeed.runtime.zero.partition_parameters import Init

    original = getattr(Init, "_zero_init_param", None)
    if original is None or not hasattr(Init, "_convert_to_deepspeed_param"):
        yield
        return

    def partition_only(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original
