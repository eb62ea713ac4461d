"""Checks before any byte of a sharded training checkpoint is read: every element a load reads is stored
(``check_covered``), and a resumed model lacks no tensor (``check_complete``)."""

from __future__ import annotations

import math
from typing import Any

from ...errors import MissingKeyError, broken_rule
from ...runs import flat_box_runs, overlap, wanted_box
from ...types import Checkpoint, LoadPlan
from .layout import RESAVE_DCP


def check_covered(checkpoint: Checkpoint, plan: LoadPlan) -> None:
    """Every element the plan reads is in a stored chunk (chunks do not overlap: ``check_chunks``), before any byte
    is read: a tensor that was not saved whole is an error, not uninitialized memory.

    Raises:
        CorruptCheckpointError: naming the key and how much of what this rank reads is stored.
    """
    reads = [(r.source, r.shard) for r in plan.reads]
    reads += [(info, None) for s in plan.submodules for c in s.conversions for _, info in c.sources]
    for info, shard in reads:
        flat = shard is not None and shard.flat
        start, stop = wanted_box(info.shape, shard)
        needed = shard.stop - shard.start if flat else math.prod(b - a for a, b in zip(start, stop))
        what = f"elements [{shard.start}, {shard.stop}) of the flattened" if flat else f"[{list(start)}, {list(stop)}) of"
        covered = 0
        for chunk in checkpoint.layout.chunks[info.key]:
            if flat:  # a ZeRO-3 partition: a range of the flattened tensor
                covered += sum(n for _, _, n in flat_box_runs(info.shape, chunk.offsets, chunk.sizes, shard.start, shard.stop))
                continue
            box = overlap(chunk.offsets, chunk.sizes, start, stop)
            if box is not None:
                covered += math.prod(h - l for l, h in zip(*box))
        if covered != needed:
            raise broken_rule(
                checkpoint.name_or_path, f"{info.key!r}", "chunks cover what is read",
                f"stored chunks holding the {needed} elements this rank reads ({what} global shape {list(info.shape)})",
                f"{covered} stored (chunks at {[list(c.offsets) for c in checkpoint.layout.chunks[info.key]]}). The checkpoint is incomplete",
                rulebook="DCP", fix=RESAVE_DCP, key=info.key,
            )


def check_complete(model: Any, plan: LoadPlan, checkpoint: Checkpoint) -> None:
    """A resumed model must come entirely from its checkpoint: a missing key is an error, not a fresh init.

    Tied targets (``lm_head.weight`` tied to the embeddings) are exempt: they are the same tensor as their source.

    Raises:
        MissingKeyError: naming the keys the checkpoint lacks.
    """
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = sorted(k for k in plan.missing_keys if k not in tied)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise MissingKeyError(
            f"{checkpoint.name_or_path} lacks {len(missing)} tensor(s) {type(model).__name__} needs: {shown}. "
            f"The checkpoint stores {len(checkpoint.tensors)} tensors; was it saved from this model "
            "(model.state_dict()) and completely? Re-save it, or pass the config it was saved with."
        )
