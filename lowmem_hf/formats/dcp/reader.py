"""The reader of a sharded training checkpoint: only the overlap of each stored chunk with this rank's slice, in
byte runs, from its byte source, straight into the destination or through the same staging as the Hub-format
readers."""

from __future__ import annotations

import functools
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from ...distributed.group import Failure, agree, current_group
from ...errors import CorruptCheckpointError, LowMemError, RankFailedError
from ...runs import box_runs, flat_box_runs, overlap, split_runs, wanted_box
from ...sources import ByteSource
from ...sources.exchange import CooperativeRanges
from ...sources.schedule import RankRuns, collect_runs
from ...types import Checkpoint, LoadPlan, ShardSpec, TensorInfo
from .. import safetensors, torch_pickle, zip_archive
from ..base import Reader, SourceFile, StreamStats, byte_view
from ..staging import Staging
from .coverage import check_covered
from .layout import DcpLayout, StoredChunk

_MAX_IOV = 1024  # IOV_MAX on Linux


@dataclass(frozen=True)
class _Located:
    """Where a chunk's raw row-major bytes start, or the whole tensor when they are not raw."""

    data_offset: int | None
    whole: torch.Tensor | None = None


def _spans(job: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Runs of a job whose source bytes follow each other: one read each (up to ``_MAX_IOV`` buffers)."""
    spans: list[list[tuple[int, int, int]]] = []
    for run in job:
        if spans and len(spans[-1]) < _MAX_IOV and spans[-1][-1][0] + spans[-1][-1][2] == run[0]:
            spans[-1].append(run)
        else:
            spans.append([run])
    return spans


class DcpReader(Reader):
    """The stream contract over a ``DcpLayout``: reads only the overlap of each stored chunk with this rank's
    slice, in byte runs, from ``source`` (local files, an object store's ranges, or their cooperative fetch)."""

    def __init__(self, layout: DcpLayout, chunk_bytes: int, stats: StreamStats, source: ByteSource):
        self._layout = layout
        self._chunk_bytes = chunk_bytes
        self._stats = stats
        self._source = source
        self._staging = Staging(stats)
        self._located: dict[StoredChunk, _Located] = {}
        self._lock = threading.Lock()
        self._extra = 0  # archive headers read to locate .distcp tensors
        if isinstance(source, CooperativeChunks):  # located before the exchange's schedule
            self._located, self._extra = dict(source.located), source.header_bytes
            for chunk, found in self._located.items():
                if found.whole is not None:
                    self._adopt_whole(chunk, found)

    def _count(self, n: int) -> None:
        with self._lock:
            self._extra += n

    def _locate(self, chunk: StoredChunk) -> _Located:
        found = self._located.get(chunk)
        if found is not None:
            return found
        found = locate(chunk, self._source, self._count)
        if found.whole is not None:
            self._adopt_whole(chunk, found)
        with self._lock:
            self._located[chunk] = found
        return found

    def _adopt_whole(self, chunk: StoredChunk, found: _Located) -> None:
        self._stats.staged(found.whole.nbytes)
        self._stats.notes.append(f"{chunk.file}: a chunk stored with non-row-major strides was read whole")

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        """Chunk reads that together fill ``dst`` with this rank's part of ``info``'s tensor, from every stored
        chunk that overlaps it. Safe to run on several threads at once."""
        jobs: list[Callable[[], None]] = []
        for chunk in self._layout.chunks[info.key]:
            runs = chunk_runs(info, shard, chunk)
            if not runs:
                continue
            self._stats.opened(chunk.file)
            jobs += [functools.partial(self._read, chunk, dst, job) for job in split_runs(runs, chunk.dtype.itemsize, self._chunk_bytes)]
        return jobs

    def _read(self, chunk: StoredChunk, dst: torch.Tensor, job: list[tuple[int, int, int]]) -> None:
        located = self._locate(chunk)
        flat = dst.view(-1)
        if located.whole is not None:
            source = located.whole.reshape(-1)
            for src, at, n in job:
                flat[at : at + n].copy_(source[src : src + n])
            return
        itemsize, source, start = chunk.dtype.itemsize, self._source, located.data_offset
        direct = dst.device.type == "cpu" and dst.dtype == chunk.dtype and dst.is_contiguous()
        for span in _spans(job):
            if direct:  # one contiguous range of the file, scattered into the destination: one call
                view = byte_view(dst)
                source.read_runs(chunk.file, [(view[at * itemsize : (at + n) * itemsize], start + src * itemsize) for src, at, n in span])
                continue
            total = sum(n for _, _, n in span) * itemsize
            buf = self._staging.get(total, device=dst.device)
            source.read(chunk.file, byte_view(buf), start + span[0][0] * itemsize)
            values, pos = buf.view(chunk.dtype), 0
            for _, at, n in span:
                self._staging.copy(flat[at : at + n], values[pos : pos + n])
                pos += n

    def done(self, info: TensorInfo, nbytes: int) -> None:
        self._stats.read(nbytes)  # through the progress bar, as every reader

    def close(self) -> None:
        super().close()
        with self._lock:
            self._located.clear()
            self._stats.header_bytes += self._extra
            self._extra = 0


def locate(chunk: StoredChunk, source: ByteSource, count: Callable[[int], None]) -> _Located:
    """Where ``chunk``'s row-major bytes start. A ``.distcp`` item is a ``torch.save`` zip: its tensor bytes are
    one uncompressed member. Read the archive's directory, its pickle and the member's local header (about 1 KiB,
    through ``source``, counted by ``count``), each checked as a ``.bin`` archive is (``zip_archive.read_archive``),
    to find where they start; a tensor stored with other strides or byte order is loaded whole instead (the
    minimal unit then)."""
    if chunk.raw:
        return _Located(chunk.byte_offset)
    where = f"{chunk.file} (the item at bytes [{chunk.byte_offset}, {chunk.byte_offset + chunk.byte_length}))"
    view = SourceFile(source, chunk.file, chunk.byte_offset, chunk.byte_length, count)
    archive = zip_archive.read_archive(view, name=where)
    tensor = torch_pickle.unpickle_locations(view, archive, name=where)
    if not isinstance(tensor, torch_pickle.StoredTensor):
        raise CorruptCheckpointError(f"{where}: the item is not a torch.save archive of one tensor. The checkpoint is corrupt: save it again.")
    member = torch_pickle.check_in_storage(f"chunk at {list(chunk.offsets)}", tensor, archive, name=where)
    if tensor.shape != chunk.sizes or tensor.dtype != chunk.dtype:
        raise CorruptCheckpointError(
            f"{where}: the item holds a {tensor.dtype} tensor of shape {list(tensor.shape)}, the checkpoint metadata "
            f"says {chunk.dtype} {list(chunk.sizes)}. The checkpoint is corrupt: save it again."
        )
    if tensor.row_major and zip_archive.byte_order(view, archive) == sys.byteorder:
        return _Located(chunk.byte_offset + member.data_offset + tensor.storage_offset * chunk.dtype.itemsize)
    whole = torch.load(
        SourceFile(source, chunk.file, chunk.byte_offset, chunk.byte_length, count), map_location="cpu", weights_only=True
    )
    return _Located(None, whole.contiguous())


def chunk_runs(info: TensorInfo, shard: ShardSpec | None, chunk: StoredChunk) -> list[tuple[int, int, int]]:
    """The ``(chunk_element, dst_element, n)`` runs of ``chunk`` that this rank's part of ``info``'s tensor (all of
    it, or ``shard``'s slice or flat partition) reads, in source order; empty where they do not overlap."""
    if shard is not None and shard.flat:  # a ZeRO-3 partition: a range of the flattened tensor
        return flat_box_runs(info.shape, chunk.offsets, chunk.sizes, shard.start, shard.stop)
    start, stop = wanted_box(info.shape, shard)
    box = overlap(chunk.offsets, chunk.sizes, start, stop)
    if box is None:
        return []
    lo, hi = box
    local = tuple(b - a for a, b in zip(start, stop))
    size = tuple(h - l for l, h in zip(lo, hi))
    return box_runs(chunk.sizes, tuple(l - o for l, o in zip(lo, chunk.offsets)), local, tuple(l - s for l, s in zip(lo, start)), size)


class CooperativeChunks(CooperativeRanges):
    """The cooperative fetch (``sources.exchange``) of a DCP checkpoint in an object store: every ``.distcp`` byte
    fetched once per job, each rank receiving only the runs its plan reads.

    The exchange schedules byte runs of files. A ``.distcp`` chunk's tensor bytes start after its archive's header,
    so before the schedule every rank locates the chunks it reads (their headers, about 1 KiB each, by its own
    range requests through ``ranges``) and turns its plan into runs of the files, in the order its reader reads
    them; the reader then starts from these locations (``located``)."""

    def __init__(self, checkpoint: Checkpoint, plan: LoadPlan, ranges: ByteSource, *, synchronous: bool = False, **options):
        self.located: dict[StoredChunk, _Located] = {}
        self.header_bytes = 0
        """Bytes of chunk headers read to locate the chunks (the load report counts them as header bytes)."""
        failure, cause = None, None
        reads = list(_planned_reads(checkpoint.layout, plan))  # the runs of every chunk, listed once
        try:
            self.located, self.header_bytes = _locate_planned(reads, ranges, threads=1 if synchronous else 16)
        except Exception as error:  # noqa: BLE001 - every rank learns it below and raises the same error
            failure, cause = Failure(str(error), error=type(error) if isinstance(error, LowMemError) else RankFailedError), error
        # a rank that failed still takes part, so that no rank waits alone in the exchange's first gather
        agree(failure, current_group(), context="cooperative fetch, locating the .distcp chunks", cause=cause)
        runs = _planned_runs(reads, self.located)
        super().__init__(checkpoint.remote, plan, ranges=ranges, runs=runs, synchronous=synchronous, **options)


def _planned_reads(layout: DcpLayout, plan: LoadPlan):
    """``(submodule, [(info, shard, chunk, runs)])`` per submodule in plan order, as ``DcpReader.jobs`` reads them."""
    for sub in plan.submodules:
        infos = [(r.source, r.shard) for r in sub.reads] + [(i, None) for c in sub.conversions for _, i in c.sources]
        yield sub.name, [
            (info, shard, chunk, runs) for info, shard in infos for chunk in layout.chunks[info.key]
            if (runs := chunk_runs(info, shard, chunk))
        ]


def _locate_planned(reads: list, source: ByteSource, *, threads: int) -> tuple[dict[StoredChunk, _Located], int]:
    """Every chunk of ``reads`` (``_planned_reads``) located (``locate``) on ``threads`` threads (1: on this one);
    and the header bytes read to do it."""
    counted = [0]
    lock = threading.Lock()

    def count(n: int) -> None:
        with lock:
            counted[0] += n

    chunks = list(dict.fromkeys(chunk for _, sub_reads in reads for _, _, chunk, _ in sub_reads))
    if threads == 1:
        return {chunk: locate(chunk, source, count) for chunk in chunks}, counted[0]
    # one header request each waits on the store's latency: many in flight, as the stream's readers do
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lowmem-locate") as pool:
        located = dict(zip(chunks, pool.map(lambda chunk: locate(chunk, source, count), chunks)))
    return located, counted[0]


def _planned_runs(reads: list, located: Mapping[StoredChunk, _Located]) -> RankRuns:
    """This rank's byte runs of the ``.distcp`` files (``reads``: ``_planned_reads``), in the order its reader reads
    them (chunks loaded whole while locating read nothing more)."""
    return collect_runs(
        (name, [
            (chunk.file, located[chunk].data_offset, [(src, n) for src, _, n in runs], chunk.dtype.itemsize)
            for _, _, chunk, runs in sub_reads if located[chunk].whole is None
        ])
        for name, sub_reads in reads
    )


def open_reader(checkpoint: Checkpoint, plan: LoadPlan, source: ByteSource, *, chunk_bytes: int, weights_only: bool, mmap: bool, stats: StreamStats) -> Reader:
    """The reader of a sharded training checkpoint (``checkpoint.layout``). ``.distcp`` items are read as raw bytes;
    the rare chunk stored with other strides is loaded with ``weights_only=True`` whatever ``weights_only`` says."""
    check_covered(checkpoint, plan)
    return DcpReader(checkpoint.layout, chunk_bytes, stats, source)


def staging_bytes(plan: LoadPlan, checkpoint: Checkpoint, *, workers: int, per_worker: int, converted: bool) -> int:
    """Host bytes the reader holds beyond the destinations: as for safetensors (raw bytes, read by ranges)."""
    return safetensors.staging_bytes(plan, checkpoint, workers=workers, per_worker=per_worker, converted=converted)
