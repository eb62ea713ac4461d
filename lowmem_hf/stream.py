"""Stream: schedule the reads of each planned tensor into memory of its final dtype and device, submodule by submodule.

What is read, and how, is the format's reader (``formats/``: ``jobs(info, dst, shard)`` returns independent reads
that together fill ``dst`` with the stored tensor or this rank's slice of it, converting on the fly) over a byte
source (``sources/``). The stream names neither; it decides where and when: the destinations (the final model's
memory, and the staged inputs of converted groups), the thread pool that runs the reads, the read-ahead window,
and the order in which submodules are yielded.

Pipelining: the reads run on a small thread pool, and the reads of the next submodules are submitted while the
current one is assigned, up to ``read_ahead_bytes`` of reads in flight beyond it; when the files are not in the
page cache, each submodule's reads are also announced (``Reader.hint``: the kernel is asked to read them ahead) as
it enters that window, and read by more threads (``COLD_WORKERS``) in larger chunks (``COLD_CHUNK_BYTES``), so a
cold disk is kept busy. Destinations are the final model's memory, so reading ahead costs no staging; submodules
are still yielded (and assigned) strictly in plan order.

Onto a CUDA device, the readers' staged copies may run on side streams (``formats.staging.CopyRing``): the stream
tells the reader when destinations were allocated (``fence``: copies into them wait for the current stream's work)
and makes each submodule's copies visible to the current stream before yielding it (``publish``); the reader's
``close`` waits for every copy, so the model is complete whichever stream reads it.
"""

from __future__ import annotations

import collections
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .formats import Reader, StreamStats
from .settings import gpu_convert_on_device, gpu_overlap, local_world_size
from .sources import ByteSource
from .sources.local import trim_heap
from .types import ConversionRead, LoadPlan, ShardSpec, SubmodulePlan, TensorInfo, TensorRead

__all__ = [
    "stream", "staging_chunk_bytes", "loaded_bytes", "choose_workers",
    "DEFAULT_CHUNK_BYTES", "COLD_CHUNK_BYTES", "COLD_STAGING_SHARE", "DEFAULT_WORKERS", "COLD_WORKERS", "DEFAULT_READ_AHEAD_BYTES",
]

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024
# From a cold disk, larger reads: 8 MiB chunks (the test disk's read-ahead window) where the warm staging cap
# leaves 1.3-2.7 MiB at 7B-70B widths. bench_shapes.py --cache cold measured them at 0.84-1.03x the time of the
# capped chunks (0.71-0.93x transformers'), and at 27 GB 0.94x the 4 MiB chunks (probe_cold.py). Their staging,
# where the dtype changes, may take 1/32 of the bytes loaded rather than 1/128: a transient 3% at most.
COLD_CHUNK_BYTES = 8 * 1024 * 1024
COLD_STAGING_SHARE = 32
DEFAULT_READ_AHEAD_BYTES = 64 * 1024 * 1024
# Chunks are read by this many threads when the files are in the page cache: preadv and copy_ release the
# GIL, so reading one chunk overlaps converting another; more threads than cores only add contention, and the
# ranks of a node share its cores (torchrun's LOCAL_WORLD_SIZE): two ranks on two cores with one reader each
# measured 0.39-0.40 s in the stream against 0.41-0.44 s with two each (benchmarks/README.md, "Shapes").
DEFAULT_WORKERS = max(1, min(4, (os.cpu_count() or 1) // local_world_size()))
# From a cold disk the threads mostly wait on I/O: more of them keep more requests queued. The ranks of a
# node share its cores (torchrun's LOCAL_WORLD_SIZE), so each gets its part.
COLD_WORKERS = max(DEFAULT_WORKERS, min(8, 4 * (os.cpu_count() or 1) // local_world_size()))


def choose_workers(cached: float | None) -> int:
    """Reader threads for a load whose files are ``cached`` (fraction in the page cache; None: unknown)."""
    return DEFAULT_WORKERS if cached is None or cached >= 0.9 else COLD_WORKERS


def staging_chunk_bytes(local_bytes: int, chunk_bytes: int, workers: int = DEFAULT_WORKERS, *, share: int = 128) -> int:
    """``chunk_bytes``, lowered so the staging buffers (``workers`` x chunk) stay within ``1/share`` of the
    ``local_bytes`` this process loads (at least 256 KiB): a rank holding a quarter of a model should not pay
    full-model staging."""
    return min(chunk_bytes, max(256 << 10, local_bytes // (share * workers)))


def loaded_bytes(plan: LoadPlan) -> int:
    """The bytes of this process's planned tensors in their loaded dtypes."""
    return sum(math.prod(r.local_shape) * r.decision.dtype.itemsize for r in plan.reads)


@dataclass
class _InFlight:
    """One submodule whose reads are submitted: its destinations, staged groups and pending chunk reads."""

    sub: SubmodulePlan
    tensors: dict[str, torch.Tensor]
    staged: list
    pairs: list
    futures: list
    nbytes: int


def stream(
    plan: LoadPlan,
    *,
    reader: Reader,
    source: ByteSource,
    device: torch.device,
    workers: int,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
    read_ahead_hints: bool = False,
    stats: StreamStats,
    into: Callable[[TensorRead], torch.Tensor | None] | None = None,
) -> Iterator[tuple[SubmodulePlan, dict[str, torch.Tensor], list[tuple[ConversionRead, list[torch.Tensor]]]]]:
    """Yield, per submodule in plan order, its loaded tensors (final dtype/device) and its staged converter inputs.

    ``reader`` (``formats.open_reader``) makes the reads, from ``source``; the stream runs them on ``workers``
    threads (1: on the calling thread, no thread started) and closes both when it ends. Reads of the following
    submodules are in flight while the caller assigns one, up to ``read_ahead_bytes`` beyond it (0: one submodule
    at a time; a submodule the source's ``may_read_ahead`` refuses waits until every earlier read is done); with
    ``read_ahead_hints`` (files not in the page cache) the reader announces them as they enter that window.
    ``into(read)`` may name memory a read lands in (a ZeRO-3 partition, filled in place); otherwise each read gets
    a fresh tensor. Nothing is kept between submodules but what the reader and source hold (staging buffers, open
    files, mapped ``.bin`` shards: each released after its file's last read, and all on exit).
    """
    device = torch.device(device)
    _note_unused_switches(device, stats)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lowmem-read") if workers > 1 else None
    hint = reader.hint if read_ahead_hints else None  # ~0.1 ms per call even when cached

    def submit(sub: SubmodulePlan) -> _InFlight:
        source.before_submodule(sub.name)  # the cooperative fetch runs its waves from here
        tensors, pairs, staged = _destinations(sub, reader=reader, device=device, into=into, stats=stats)
        reader.fence(device)
        jobs = []
        for info, dst, shard in pairs:
            if hint is not None:
                hint(info, shard)
            jobs += reader.jobs(info, dst, shard)
        jobs = source.arrange(sub.name, jobs)
        futures = [pool.submit(job) for job in jobs] if pool is not None else jobs
        return _InFlight(sub, tensors, staged, pairs, futures, _read_bytes(sub))

    pending = collections.deque(plan.submodules)
    window: collections.deque[_InFlight] = collections.deque()
    ahead = 0  # bytes submitted beyond the submodule at the head of the window
    try:
        while pending or window:
            # queue the next submodules' reads behind the current one, within the budget (none without a pool)
            while pending and (not window or pool is not None and ahead + _read_bytes(pending[0]) <= read_ahead_bytes
                               and source.may_read_ahead(pending[0].name)):
                item = submit(pending.popleft())
                ahead += item.nbytes if window else 0
                window.append(item)
            head = window.popleft()
            _finish(head, reader, threaded=pool is not None)
            reader.publish()  # a CUDA destination may have been written on the readers' side streams
            if window:
                ahead -= window[0].nbytes  # the next one becomes the head
            yield head.sub, head.tensors, head.staged
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        trim_heap()  # the reader threads' malloc arenas, or the main one where the reads ran on this thread
        try:
            reader.close()
        finally:
            source.close()


def _destinations(
    sub: SubmodulePlan, *, reader: Reader, device: torch.device, into: Callable[[TensorRead], torch.Tensor | None] | None,
    stats: StreamStats,
) -> tuple[dict[str, torch.Tensor], list[tuple[TensorInfo, torch.Tensor, ShardSpec | None]], list[tuple[ConversionRead, list[torch.Tensor]]]]:
    """Where each read of ``sub`` lands: the tensors by target (a view of the file where the reader makes one, else
    ``into``'s memory or a fresh tensor), the ``(source, destination, shard)`` pairs to read, and each converter's
    staged inputs."""
    tensors, pairs = {}, []
    for r in sub.reads:
        mapped = reader.view(r.source, r.decision.dtype, r.local_shape, r.shard, device)
        if mapped is not None:
            tensors[r.target] = mapped
            reader.done(r.source, 0)
            continue
        dst = into(r) if into is not None else None
        tensors[r.target] = dst if dst is not None else torch.empty(r.local_shape, dtype=r.decision.dtype, device=device)
        pairs.append((r.source, tensors[r.target], r.shard))
    staged = []
    for c in sub.conversions:
        # transformers converts on the sources cast to the target dtype; stage exactly that.
        inputs = [torch.empty(i.shape, dtype=c.decision.dtype, device=device) for _, i in c.sources]
        pairs += [(info, dst, None) for (_, info), dst in zip(c.sources, inputs)]
        stats.staged(sum(t.numel() * t.element_size() for t in inputs))
        staged.append((c, inputs))
    return tensors, pairs, staged


def _finish(item: _InFlight, reader: Reader, *, threaded: bool) -> None:
    """Wait for ``item``'s reads (or run them, without threads), then tell the reader what each read."""
    if not threaded:
        for job in item.futures:
            job()
    else:
        for future in item.futures:
            future.result()  # re-raises the first error, e.g. a file truncated mid-load
    for info, dst, _ in item.pairs:
        reader.done(info, dst.numel() * info.dtype.itemsize)


def _note_unused_switches(device: torch.device, stats: StreamStats) -> None:
    """A switch set to 1 that this load cannot honour is said in the report, not dropped silently."""
    if device.type == "cuda":
        return
    for name, asked in (("LOWMEM_HF_GPU_OVERLAP", gpu_overlap()), ("LOWMEM_HF_GPU_CONVERT_ON_DEVICE", gpu_convert_on_device())):
        if asked:
            stats.notes.append(f"{name}=1 applies to loads onto a CUDA device; this load is onto {device}, so it changed nothing.")


def _read_bytes(sub: SubmodulePlan) -> int:
    """Bytes a submodule reads at most (the read-ahead budget counts these; ``mmap=True`` views read none)."""
    total = sum(math.prod(r.local_shape) * r.source.dtype.itemsize for r in sub.reads)
    return total + sum(math.prod(i.shape) * i.dtype.itemsize for c in sub.conversions for _, i in c.sources)
