"""What a planned load will cost, from the plan alone: bytes to read and download, final bytes, predicted peak.

The dry run (``lowmem-hf plan``) prints this for every rank without reading a tensor byte; an actual load of
the same request reads exactly ``bytes_to_read`` and ends with ``final_bytes`` of parameters and buffers.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import torch
from torch.distributed.tensor import DTensor

from . import settings
from .formats import FORMATS
from .types import Checkpoint, CheckpointFormat, LoadPlan

__all__ = ["PlanEstimate", "estimate_plan", "bytes_to_read", "final_bytes"]


@dataclass(frozen=True)
class PlanEstimate:
    """One rank's load, predicted before any tensor byte is read."""

    rank: int
    """The tensor-parallel rank (0 without TP)."""
    files: tuple[str, ...]
    """Weight files this rank touches (repo paths for Hub loads)."""
    bytes_to_read: int
    """Tensor bytes read plus checkpoint header bytes: exactly ``LoadReport.bytes_read`` of the load."""
    bytes_to_download: int
    """Bytes still to come from the network (0 for local folders and files already in the HF cache)."""
    final_bytes: int
    """Parameters and buffers this rank holds after the load: exactly ``LoadReport.model_bytes``."""
    staging_bytes: int
    """The most host memory the stream holds beyond the model at once (chunk buffers, converted groups)."""
    predicted_peak_bytes: int
    """Peak host memory above the process baseline: ``final_bytes + staging_bytes``."""
    dtype_summary: tuple[str, ...]
    """``"<n> x <from> -> <to> (<rule>)"``, most common first: how many tensors cast how, by which rule."""

    def to_json(self) -> dict:
        return asdict(self)


def bytes_to_read(plan: LoadPlan) -> int:
    """Tensor bytes this plan reads: each read's (sliced) source bytes, and every converted source whole."""
    return sum(_bytes_by_file(plan).values())


def _bytes_by_file(plan: LoadPlan) -> Counter:
    by_file: Counter = Counter()
    for r in plan.reads:
        by_file[r.source.file] += math.prod(r.local_shape) * r.source.dtype.itemsize
    for s in plan.submodules:
        for c in s.conversions:
            for _, info in c.sources:
                by_file[info.file] += info.nbytes
    return by_file


def final_bytes(model: torch.nn.Module, plan: LoadPlan) -> int:
    """Bytes of the model's unique parameters and buffers after the load (this rank's shards under TP).

    Loaded tensors take their read's local shape and decided dtype; the rest (missing keys, non-persistent
    buffers, converted outputs) keep what the skeleton on meta says. Tied targets share their source's memory.
    """
    reads = {r.target: r for r in plan.reads}
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    total, seen = 0, set()
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if name in tied or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        read = reads.get(name)
        if read is not None:
            total += math.prod(read.local_shape) * read.decision.dtype.itemsize
            continue
        local = tensor.data.to_local() if isinstance(tensor.data, DTensor) else tensor
        shape = plan.shards[name].local_shape(tuple(local.shape)) if name in plan.shards else tuple(local.shape)
        total += math.prod(shape) * local.dtype.itemsize
    return total


def _staging_bytes(plan: LoadPlan, checkpoint: Checkpoint, *, chunk_bytes: int, workers: int, device: torch.device) -> int:
    """The stream's largest host footprint beyond the destinations: its reader's (``formats/``), or a converted group."""
    converted = [r for r in plan.reads if r.decision.dtype != r.source.dtype]
    onto_device = torch.device(device).type == "cuda"
    # each worker thread's buffer grows to the largest chunk it stages: at most chunk_bytes, at most one tensor
    staged = plan.reads if onto_device else (converted or plan.reads)
    largest = max((math.prod(r.local_shape) * r.source.dtype.itemsize for r in staged), default=0)
    per_worker = min(chunk_bytes, largest)
    if onto_device:  # every chunk goes through pinned host staging, two buffers per thread while copies overlap reads
        reader = workers * per_worker * (1 if settings.gpu_overlap() is False else 2)
    else:
        reader = FORMATS[checkpoint.format].staging_bytes(plan, checkpoint, workers=workers, per_worker=per_worker, converted=bool(converted))
    groups = [
        sum(math.prod(i.shape) * c.decision.dtype.itemsize for _, i in c.sources)
        for s in plan.submodules
        for c in s.conversions
    ]
    return max([reader, *groups])


def _dtype_summary(plan: LoadPlan) -> tuple[str, ...]:
    counts = Counter(
        (str(r.source.dtype).removeprefix("torch."), str(r.decision.dtype).removeprefix("torch."), r.decision.rule)
        for r in plan.reads
    )
    for s in plan.submodules:
        for c in s.conversions:
            for _, info in c.sources:
                counts[(str(info.dtype).removeprefix("torch."), str(c.decision.dtype).removeprefix("torch."), c.decision.rule)] += 1
    return tuple(f"{n} x {src} -> {dst} ({rule})" for (src, dst, rule), n in counts.most_common())


def estimate_plan(
    model: torch.nn.Module,
    plan: LoadPlan,
    checkpoint: Checkpoint,
    *,
    rank: int,
    chunk_bytes: int,
    workers: int,
    cached: Iterable[str] = (),
    fetch: str = "files",
    device: torch.device | str = "cpu",
) -> PlanEstimate:
    """Predict one rank's load from its plan (``cached``: repo paths already in the HF cache)."""
    by_file = _bytes_by_file(plan)
    download = 0
    if checkpoint.repo_id is not None:
        missing = [f for f in plan.files if f not in set(cached)]
        if fetch == "ranges" and checkpoint.format == CheckpointFormat.SAFETENSORS:
            download = sum(by_file[f] for f in missing)  # only the planned ranges cross the network
        else:
            remote: Mapping = checkpoint.remote
            download = sum(remote[f].size for f in missing if f in remote)
    final = final_bytes(model, plan)
    staging = _staging_bytes(plan, checkpoint, chunk_bytes=chunk_bytes, workers=workers, device=device)
    return PlanEstimate(
        rank=rank,
        files=plan.files,
        bytes_to_read=sum(by_file.values()) + checkpoint.header_bytes,
        bytes_to_download=download,
        final_bytes=final,
        staging_bytes=staging,
        predicted_peak_bytes=final + staging,
        dtype_summary=_dtype_summary(plan),
    )
