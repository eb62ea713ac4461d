"""The data that crosses stage boundaries: resolve -> plan -> stream -> assign.

Every class here is a frozen dataclass; a stage receives one and returns another, never mutates one.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

__all__ = [
    "CheckpointFormat",
    "TensorInfo",
    "RemoteFile",
    "Checkpoint",
    "ShardSpec",
    "TensorRead",
    "ConversionRead",
    "SubmodulePlan",
    "LoadPlan",
    "DtypeDecision",
    "LoadReport",
    "file_identity",
]


class CheckpointFormat:
    """How a weight file stores its tensors (a namespace of string constants)."""

    SAFETENSORS = "safetensors"
    TORCH_ZIP = "torch_zip"  # torch.save since 1.6: a zip archive, one record per storage
    TORCH_LEGACY = "torch_legacy"  # the pre-1.6 pickle stream: no random access at all
    DCP = "dcp"  # torch.distributed.checkpoint: `.metadata` + `*.distcp`, or transformers' `shard-*` safetensors


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as stored in a checkpoint file, known from headers alone."""

    key: str
    """The key as written in the checkpoint (before any rename)."""
    file: str
    """Absolute path of the file that holds it."""
    dtype: torch.dtype
    """The stored dtype."""
    shape: tuple[int, ...]
    """The stored shape."""
    offset: int | None
    """Absolute byte offset of the first element in ``file`` (safetensors); ``None`` where the format hides it."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class RemoteFile:
    """A weight file of a Hub repo pinned to one commit, or an object of an object store pinned to its ETag."""

    filename: str
    """Path inside the repo, or inside the store's prefix (subfolder included)."""
    url: str
    """Its ``resolve`` URL at the pinned commit; an object's URL (``s3://bucket/prefix/file``)."""
    size: int
    etag: str | None
    version: str | None = None
    """Object stores with versioning: the object's ``VersionId``, read instead of whatever is the latest."""


@dataclass(frozen=True)
class Checkpoint:
    """A resolved checkpoint: where the config and every tensor are, read from headers only."""

    name_or_path: str
    """What the caller passed."""
    format: str
    """One of the ``CheckpointFormat`` values; one format per checkpoint."""
    files: tuple[str, ...]
    """The weight files, in index order."""
    tensors: Mapping[str, TensorInfo]
    """Every stored tensor by checkpoint key."""
    index_metadata: Mapping[str, Any] | None
    """The ``metadata`` block of a sharded index, ``None`` for a single file."""
    header_bytes: int
    """Bytes read to learn the above (headers and index; pickles for ``.bin``)."""
    repo_id: str | None = None
    """The Hub repo, or ``None`` for a local folder."""
    commit: str | None = None
    """The commit every file of a Hub load comes from."""
    remote: Mapping[str, RemoteFile] = field(default_factory=dict)
    """Hub loads: ``TensorInfo.file`` (a repo path) -> the remote file. Empty for local folders."""
    local_paths: Mapping[str, str] = field(default_factory=dict)
    """Hub loads: repo path -> file already in the HF cache (read locally, never fetched again)."""
    layout: Any = None
    """Sharded training checkpoints (``CheckpointFormat.DCP``): where each stored chunk of every tensor is
    (a ``formats.dcp.DcpLayout``); ``None`` for the Hub layout."""
    store: Any = None
    """Object-store loads: the ``sources.objectstore.ObjectStore`` the ``remote`` objects are read from."""
    config_dir: str | None = None
    """Object-store loads: the local folder holding the checkpoint's small files (config, generation config)."""
    identities: Mapping[str, tuple[int, int, int, int]] = field(default_factory=dict)
    """Local folders: each weight file's ``(st_dev, st_ino, st_size, st_mtime_ns)`` from just before its header was
    read. The load reads tensor bytes only from files that are still exactly these (``sources.local.LocalFiles``)."""


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What says a file is still the one whose header was read, unchanged."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class DtypeDecision:
    """Which dtype a tensor gets, and which rule chose it."""

    dtype: torch.dtype
    rule: str
    """``declared``, ``loaded``, ``module`` (the module builds it in another dtype), ``keep_in_fp32``,
    ``keep_in_fp32_strict`` or ``override:<pattern>``."""


@dataclass(frozen=True)
class ShardSpec:
    """This rank's slice of one parameter: ``[start, stop)`` along ``dim`` of the global shape (or ``intervals``)."""

    style: str
    """The tensor-parallel style that shards it (transformers' name, e.g. ``colwise``); on a mesh without a TP
    style for it, its DTensor placements (e.g. ``(Replicate(), Shard(dim=0))``)."""
    dim: int
    start: int
    stop: int
    tp_rank: int
    tp_size: int
    intervals: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Every dim's local index set as sorted ``(start, stop)`` runs, when the slice is more than one range of
    ``dim`` (meshes: several sharded dims, strided shards). ``None``: ``[start, stop)`` of ``dim``, all of the rest."""
    flat: bool = False
    """``[start, stop)`` are elements of the flattened tensor (a DeepSpeed ZeRO-3 partition), not indices of ``dim``."""

    def local_shape(self, global_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.flat:
            return (self.stop - self.start,)
        if self.intervals is not None:
            return tuple(sum(b - a for a, b in runs) for runs in self.intervals)
        shape = list(global_shape)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)


@dataclass(frozen=True)
class TensorRead:
    """Read one checkpoint tensor (or this rank's slice of it) into one model parameter or buffer."""

    target: str
    """Fully qualified name in the model."""
    source: TensorInfo
    decision: DtypeDecision
    shard: ShardSpec | None = None
    """The slice this rank reads; ``None`` reads the whole tensor."""

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.shard.local_shape(self.source.shape) if self.shard else self.source.shape


@dataclass(frozen=True)
class ConversionRead:
    """Several checkpoint tensors that transformers converts (merge, split, concat...) into model tensors.

    These cannot land in place: the sources are staged at the target dtype, converted with transformers'
    own ``WeightConverter``, then assigned. The staging costs the group's bytes, once per group.
    """

    first_target: str
    """The target key transformers files the group under."""
    converter: Any
    """A private copy of transformers' ``WeightConverter`` for this group."""
    sources: tuple[tuple[str, TensorInfo], ...]
    """``(source_pattern, tensor)`` in the order transformers collects them."""
    decision: DtypeDecision


@dataclass(frozen=True)
class SubmodulePlan:
    """Everything one submodule (e.g. one decoder layer) needs, streamed and assigned together."""

    name: str
    reads: tuple[TensorRead, ...]
    conversions: tuple[ConversionRead, ...] = ()


@dataclass(frozen=True)
class LoadPlan:
    """What this process reads, from where, into which names and dtypes; computed before any tensor byte."""

    submodules: tuple[SubmodulePlan, ...]
    missing_keys: frozenset[str]
    unexpected_keys: frozenset[str]
    mismatched_keys: frozenset[tuple[str, tuple[int, ...], tuple[int, ...]]]
    """``(key, checkpoint_shape, model_shape)``, only with ``ignore_mismatched_sizes=True``."""
    dtype: torch.dtype
    """The model's declared dtype (``config.dtype``)."""
    weight_conversions: tuple[Any, ...]
    """transformers' renames/converters that matched a key; kept on the model for ``save_pretrained``."""
    shards: Mapping[str, ShardSpec] = field(default_factory=dict)
    """Tensor parallelism: this rank's slice of every sharded parameter (empty without TP)."""

    @property
    def reads(self) -> tuple[TensorRead, ...]:
        return tuple(r for s in self.submodules for r in s.reads)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(self.reads_per_file())

    def reads_per_file(self) -> dict[str, int]:
        """How many stored tensors this plan reads from each file (a converted group's sources included), files in
        the order the plan first reads them: a reader lets a file go after its last read."""
        counts: dict[str, int] = {}
        for s in self.submodules:
            for r in s.reads:
                counts[r.source.file] = counts.get(r.source.file, 0) + 1
            for c in s.conversions:
                for _, t in c.sources:
                    counts[t.file] = counts.get(t.file, 0) + 1
        return counts


@dataclass(frozen=True)
class LoadReport:
    """What a load did. Also answers ``report["missing_keys"]`` etc. like transformers' loading info."""

    missing_keys: frozenset[str]
    unexpected_keys: frozenset[str]
    mismatched_keys: frozenset[tuple[str, tuple[int, ...], tuple[int, ...]]]
    error_msgs: tuple[str, ...]
    checkpoint_format: str
    files_read: tuple[str, ...]
    """Weight files opened, in the order they were read."""
    bytes_read: int
    """Bytes read from weight files (tensor data) plus ``header_bytes``."""
    header_bytes: int
    """Format metadata read: headers, indexes, DCP metadata (planning), and archive directories read while streaming."""
    dtype: torch.dtype
    """The declared model dtype (``config.dtype``)."""
    dtype_policy: str
    dtype_decisions: Mapping[str, DtypeDecision]
    """Per loaded tensor: its dtype and the rule that chose it."""
    model_bytes: int
    """Bytes of all unique parameters and buffers of the returned model."""
    staging_bytes: int
    """Largest host staging held at once (chunk buffer, converted groups, legacy pickles)."""
    wall_seconds: float
    peak_rss_anon_bytes: int
    """Largest ``RssAnon`` seen in this process at submodule boundaries (0 where /proc is absent)."""
    peak_vm_hwm_bytes: int
    """``VmHWM`` of this process after the load (includes file-backed pages; 0 where /proc is absent)."""
    notes: tuple[str, ...] = field(default=())
    """Anything the caller should know (e.g. a legacy pickle that had to be read whole)."""
    shards: Mapping[str, ShardSpec] = field(default_factory=dict)
    """Tensor parallelism: the slice of each sharded parameter this rank holds (empty without TP)."""
    commit: str | None = None
    """Hub loads: the commit every file came from."""
    mapped_bytes: int = 0
    """``mmap=True``: bytes of tensors that are copy-on-write views of checkpoint files (not in ``bytes_read``)."""
    stage_seconds: Mapping[str, float] = field(default_factory=dict)
    """Where ``wall_seconds`` went, stage by stage: ``prepare`` (resolve, build on meta, plan), ``fetch`` (the byte
    source opened: Hub files downloaded), ``stream`` (reads, conversion and assignment, submodule by submodule) and
    ``finish`` (transformers' finishing steps and the post-conditions)."""
    reader_workers: int = 0
    """Reader threads the stream used (chosen from the cores and whether the files were in the page cache)."""
    chunk_bytes: int = 0
    """Bytes per read and conversion the stream used: the requested ``chunk_bytes``, lowered for local files so
    the staging (reader threads x chunk) stays within 1/128 of what this rank loads."""
    page_cache_fraction: float | None = None
    """Local files: the fraction of their pages in the page cache when the load began (``mincore``); below 0.9
    the load read them as cold (more reader threads, larger chunks, read-ahead hints, no reads through gaps). None: not local."""
    requests: int = 0
    """``fetch="ranges"``: HTTP requests this process made."""
    bytes_fetched: int = 0
    """``fetch="ranges"``: body bytes this process received from the network."""
    bytes_received: int = 0
    """Cooperative fetch (``fetch="ranges"`` under a process group): bytes received from other ranks."""
    gap_bytes: int = 0
    """Sliced tensors from local files in the page cache: bytes between a slice's runs (e.g. the other ranks' part
    of each row) copied by the same read and dropped, so a slice costs a few calls instead of one per row. Not in
    ``bytes_read``; never read from a cold disk (there each run is its own read)."""

    _LEGACY_KEYS = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")

    def __getitem__(self, key: str):
        if key not in self._LEGACY_KEYS:
            raise KeyError(f"{key!r}: a LoadReport answers {', '.join(self._LEGACY_KEYS)} by key; read other fields as attributes")
        value = getattr(self, key)
        return list(value) if key == "error_msgs" else set(value)

    def keys(self):
        return iter(self._LEGACY_KEYS)

    def to_dict(self) -> dict:
        """The four entries of transformers' ``output_loading_info`` dict, with transformers' container types."""
        return {k: self[k] for k in self._LEGACY_KEYS}
