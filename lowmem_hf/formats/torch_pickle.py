"""torch pickles (``pytorch_model.bin``): ``torch.save`` zip archives since torch 1.6, legacy pickle streams before.

What only this format knows: learning shapes and dtypes without the data (``read_header``: a zip archive is
unpickled onto ``meta``), and reading the tensors through torch's own loader (``TorchReader``).

- zip: ``torch.load(mmap=True, weights_only=...)`` once per shard (kept mapped until its last planned tensor is
  read), copied chunk by chunk; each chunk's pages are dropped from the mapping right after (``madvise``), so the
  resident file-backed memory stays a chunk per reader thread, not a shard. From a cold disk each tensor's pages
  are announced (``madvise(WILLNEED)``) as it enters the read-ahead window (``bench_usable.py``, 2 GB fp32 ->
  bf16, one process, cold: 1.07x transformers against 1.20x and 1.35x without).
- legacy pickle: has no random access; the shard is loaded whole (the report says what it cost).
"""

from __future__ import annotations

import functools
import os
import zipfile
from collections import Counter
from typing import Callable

import torch

from ..errors import CorruptCheckpointError
from ..plan.sharding import chunk_spans, element_runs, slice_tensor
from ..sources import ByteSource
from ..sources.local import LocalFiles, release_pages, will_need_pages
from ..types import Checkpoint, CheckpointFormat, LoadPlan, ShardSpec, TensorInfo
from .base import Reader, StreamStats

__all__ = ["read_header", "TorchReader", "open_reader", "staging_bytes"]


def read_header(path: str, *, weights_only: bool) -> tuple[dict[str, TensorInfo], int, str]:
    """Shapes and dtypes of a ``torch.save`` file without reading tensor data.

    A zip archive is unpickled onto ``meta`` (torch reads only ``data.pkl``); a legacy pickle
    stream interleaves data and pickle, so learning its shapes reads the whole file once.

    Returns:
        ``({key: TensorInfo}, bytes_read, CheckpointFormat)``.
    """
    is_zip = zipfile.is_zipfile(path)
    try:
        state = torch.load(path, map_location="meta", weights_only=weights_only, mmap=False)
    except Exception as e:  # torch raises a zoo of types here (UnpicklingError, RuntimeError, EOFError...)
        hint = (
            " If you trust this file, pass weights_only=False to allow arbitrary pickles."
            if weights_only and "weights_only" in str(e)
            else " The file is corrupt or not a torch.save checkpoint: download or copy it again."
        )
        raise CorruptCheckpointError(f"{path}: torch.load could not read it ({type(e).__name__}: {e}).{hint}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptCheckpointError(
            f"{path} holds a {type(state).__name__}, not a state dict of tensors; save weights with "
            "torch.save(model.state_dict(), path)."
        )
    if is_zip:
        with zipfile.ZipFile(path) as z:
            pkl = next((i for i in z.infolist() if i.filename.endswith("data.pkl")), None)
            nbytes = pkl.file_size if pkl is not None else 0
    else:
        nbytes = os.path.getsize(path)
    infos = {
        k: TensorInfo(key=k, file=path, dtype=v.dtype, shape=tuple(v.shape), offset=None) for k, v in state.items()
    }
    return infos, nbytes, CheckpointFormat.TORCH_ZIP if is_zip else CheckpointFormat.TORCH_LEGACY


class TorchReader(Reader):
    """Reads ``torch.save`` shards: zip archives mmapped (each kept until its last planned tensor is read), legacy
    pickles loaded whole, one at a time. torch's own loader reads them, so they must be local files (``source``;
    None: each ``TensorInfo.file`` is a local path)."""

    def __init__(self, plan_counts: dict[str, int], chunk_bytes: int, weights_only: bool, stats: StreamStats, source: LocalFiles | None = None):
        self._source = source if source is not None else LocalFiles()
        self._remaining = dict(plan_counts)
        self._chunk_bytes = chunk_bytes
        self._weights_only = weights_only
        self._stats = stats
        # Open shards by file. A mapped shard costs no memory beyond the pages being copied (each chunk's are
        # dropped after), so read-ahead into the next shard keeps the current one instead of unpickling it again
        # when a submodule's tensors come from both (it did: 7 torch.load calls for 5 shards of the 2 GB Llama).
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        # Which of them are mappings (zip) rather than whole pickles in memory, per file: a checkpoint may mix the
        # two, and dropping pages (``release_pages``) of a legacy shard's heap memory would destroy it.
        self._mapped: set[str] = set()

    def _load(self, file: str) -> dict[str, torch.Tensor]:
        state = self._states.get(file)
        if state is None:
            path = self._source.path(file)
            mapped = zipfile.is_zipfile(path)
            if mapped:
                self._mapped.add(file)
            else:
                self._states.clear()  # a legacy pickle is the whole shard in memory: never two at once
            state = self._states[file] = torch.load(path, map_location="cpu", weights_only=self._weights_only, mmap=mapped)
            self._stats.opened(file)
            if not mapped:
                size = os.path.getsize(path)
                self._stats.staged(size)
                self._stats.notes.append(
                    f"{path} is a legacy (non-zip) torch pickle: it was loaded whole, costing {size} bytes "
                    "of host memory at once. Re-save it with torch.save (torch>=1.6) or as safetensors to stream it."
                )
        return state

    def hint(self, info: TensorInfo, shard: ShardSpec | None) -> None:
        """Cold files: ask the kernel to read this tensor's (slice's) pages of the shard mapping now
        (``madvise(WILLNEED)``), as ``SafetensorsReader.hint`` does with file offsets, so the reader threads'
        page faults find them in flight instead of each starting its own small read."""
        full = self._load(info.file)[info.key]
        runs = element_runs(info.shape, shard)
        if info.file not in self._mapped or not runs or not full.is_contiguous():
            return
        itemsize, (first, _), (last, n) = info.dtype.itemsize, runs[0], runs[-1]
        if sum(m for _, m in runs) * 2 >= last + n - first:  # dense enough, as for safetensors
            will_need_pages(full.data_ptr() + first * itemsize, (last + n - first) * itemsize)

    def jobs(self, info: TensorInfo, dst: torch.Tensor, shard: ShardSpec | None = None) -> list[Callable[[], None]]:
        full = self._load(info.file)[info.key]
        src = slice_tensor(full, shard)
        mapped = info.file in self._mapped  # decided now: the job runs after other shards may have been loaded
        if not (mapped and src.is_contiguous()):

            def whole() -> None:
                dst.copy_(src)
                if mapped and full.is_contiguous():
                    release_pages(full)

            return [whole]
        s, d = src.reshape(-1), dst.view(-1)

        def chunk(start: int, stop: int) -> None:
            d[start:stop].copy_(s[start:stop])
            release_pages(s[start:stop])

        return [functools.partial(chunk, a, b) for a, b in chunk_spans(src.numel(), info.dtype.itemsize, self._chunk_bytes)]

    def done(self, info: TensorInfo, nbytes: int) -> None:
        self._stats.read(nbytes)
        self._remaining[info.file] -= 1
        if self._remaining[info.file] == 0:
            self._states.pop(info.file, None)  # the last reference: unmaps the file (zip) or frees it (legacy)

    def close(self) -> None:
        self._states.clear()


def open_reader(checkpoint: Checkpoint, plan: LoadPlan, source: ByteSource, *, chunk_bytes: int, weights_only: bool, mmap: bool, stats: StreamStats) -> Reader:
    """The reader of a ``.bin`` checkpoint (``mmap=True`` was refused for it before the stream began)."""
    return TorchReader(plan.reads_per_file(), chunk_bytes, weights_only, stats, source)


def staging_bytes(plan: LoadPlan, checkpoint: Checkpoint, *, workers: int, per_worker: int, converted: bool) -> int:
    """Host bytes the reader holds beyond the destinations: a zip archive's mapped pages of the chunk each reader
    thread copies; a legacy pickle, its largest shard (loaded whole, one shard at a time)."""
    if checkpoint.format == CheckpointFormat.TORCH_ZIP:
        return workers * per_worker
    sizes = Counter()
    for info in checkpoint.tensors.values():
        sizes[info.file] += info.nbytes
    return max((sizes[f] for f in plan.files), default=0)
