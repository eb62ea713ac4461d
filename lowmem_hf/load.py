"""The recipe, in two halves: ``prepare`` (resolve, build on meta, plan: no tensor byte) and ``execute`` (choose the
byte source, stream, finish, report).

    prepared = prepare(request)         # one pinned revision, headers only, the skeleton, this rank's plan
    model, report = execute(prepared)   # fetch, stream submodule by submodule, assign, finalize, prove, report

Each step is a call into its own module: ``routing`` (transformers' model class and config, the checkpoint's
resolution), ``build`` (the skeleton on meta and its dtype), ``distributed`` (the engine that places the
parameters), ``plan/`` (the dtype policy, this rank's reads), ``fetch/`` (the byte source), ``stream`` and
``assign``, ``report``. ``from_pretrained`` is both halves; a dry run (``lowmem-hf plan``) is
``prepare`` alone. Everything model-specific (config classes, key renames, dtype rules, init, tying) is
transformers' own.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from transformers import PreTrainedModel

from . import assign as _assign
from .build import build, decide_dtype, reject_empty_plan
from .compat import transformers_api as hf
from .distributed import Engine, engine_for
from .distributed.tp import TPRequest, rank_device, request_tp
from .estimate import PlanEstimate, bytes_to_read, estimate_plan
from .fetch.choose import FetchOptions, open_source, reads_local_files
from .formats import StreamStats, dcp, open_reader
from .formats.safetensors import check_mmap
from .hub import pin_revision
from .logs import log_load
from .plan import DtypePolicy, KeyMapping, make_plan, map_checkpoint_keys
from .plan.planner import decisions_of
from .progress import byte_bar
from .request import LoadRequest
from .resolve_store import is_store_url
from .report import report_of
from .routing import (
    generation_config_source, init_params, is_hub_repo, reject_adapter, reject_quantized, reject_unknown,
    pin_stored, resolve_checkpoint, resolve_class_and_config, resolve_stored,
)
from .settings import async_load, proc_status_bytes
from .sources import ByteSource
from .sources.local import cached_fraction
from .stream import COLD_CHUNK_BYTES, COLD_STAGING_SHARE, DEFAULT_CHUNK_BYTES, choose_workers, loaded_bytes, staging_chunk_bytes, stream
from .types import Checkpoint, CheckpointFormat, DtypeDecision, LoadPlan, LoadReport

STAGES = ("prepare", "fetch", "stream", "finish")
"""The stages ``LoadReport.stage_seconds`` times, in the order they run."""

__all__ = ["PreparedLoad", "prepare", "execute", "load"]


@dataclass(frozen=True)
class PreparedLoad:
    """Everything decided before any tensor byte is read. ``execute`` consumes it once (it fills ``model``)."""

    request: LoadRequest
    """The request, pinned to one commit for Hub repos."""
    model: Any
    """The skeleton on ``meta`` (meta DTensors under distributed TP), with its final config."""
    checkpoint: Checkpoint
    plan: LoadPlan
    """This rank's reads, submodule by submodule, with dtype decisions and slices."""
    policy: DtypePolicy
    mapping: KeyMapping
    engine: Engine
    """How the parameters are placed (``distributed.engine_for``): whole, TP/mesh shards, or ZeRO-3 partitions."""
    started: float
    """``time.perf_counter()`` when ``prepare`` began (the report's wall time counts from here)."""

    @property
    def tp(self) -> TPRequest | None:
        """The validated tensor-parallel request, ``None`` without TP."""
        return self.engine.tp

    @property
    def stream_chunk_bytes(self) -> int:
        """The stream's chunk size: ``chunk_bytes`` as requested (by default 4 MiB) for HTTP ranges and DCP
        chunks; from local files in the page cache the same, capped so staging stays small next to what this rank
        loads (``staging_chunk_bytes``); from a cold disk by default ``COLD_CHUNK_BYTES``, with the cap at
        ``COLD_STAGING_SHARE`` rather than 128."""
        checkpoint, requested = self.checkpoint, self.request.chunk_bytes
        if not reads_local_files(checkpoint, self.request.fetch) or checkpoint.format == CheckpointFormat.DCP:
            return requested or DEFAULT_CHUNK_BYTES
        if self.cold:
            return staging_chunk_bytes(loaded_bytes(self.plan), requested or COLD_CHUNK_BYTES, self.workers, share=COLD_STAGING_SHARE)
        return staging_chunk_bytes(loaded_bytes(self.plan), requested or DEFAULT_CHUNK_BYTES, self.workers)

    @cached_property
    def page_cache_fraction(self) -> float | None:
        """How much of the local files this load reads is in the page cache (``mincore``); None: not local."""
        local = [self.checkpoint.local_paths.get(f, f) for f in self.plan.files] if not self.checkpoint.remote else []
        local = [p for p in local if os.path.isfile(p)]
        return cached_fraction(local) if local else None

    @property
    def workers(self) -> int:
        """Reader threads: the cores when the files are in the page cache, more when they must come from disk;
        1 (every read on the calling thread, no thread started) under ``HF_DEACTIVATE_ASYNC_LOAD``."""
        return choose_workers(self.page_cache_fraction) if async_load() else 1

    @property
    def cold(self) -> bool:
        """Files mostly not in the page cache: the stream then announces its reads ahead to the kernel, and the
        local source reads through no gap (``LocalFiles.for_load``)."""
        return self.page_cache_fraction is not None and self.page_cache_fraction < 0.9

    def estimate(self) -> PlanEstimate:
        """What ``execute`` will read, download and hold on this rank (the dry run's numbers)."""
        return estimate_plan(
            self.model, self.plan, self.checkpoint,
            rank=self.engine.rank,
            chunk_bytes=self.stream_chunk_bytes, workers=self.workers,
            cached=self.checkpoint.local_paths, fetch=self.request.fetch, device=self.request.device,
        )


def prepare(request: LoadRequest) -> PreparedLoad:
    """Resolve the checkpoint, build the model on ``meta`` and plan this rank's reads; reads no tensor byte.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError: the checkpoint is missing or its headers are bad.
        TypeError: an unknown keyword among the config overrides (names the closest valid one).
        ShapeMismatchError, ValueError, NotImplementedError: a plan that cannot be executed, before any I/O.
    """
    started = time.perf_counter()
    # TP first: under torchrun this creates the process group, which the revision pinning below uses so
    # that every rank loads rank 0's commit (transformers' mesh set-up does not depend on the model class).
    tp_request = request_tp(PreTrainedModel, **vars(request.tp))
    request = replace(request, device=rank_device(tp_request, request.device))
    store = pin_stored(request) if is_store_url(request.name_or_path) else None  # listed once, small files mirrored
    if store is None and request.storage_options is not None:
        raise ValueError(
            f"storage_options is for object-store URLs (s3://bucket/prefix, any fsspec URL), but "
            f"{request.name_or_path!r} is a local folder or a Hub repo id, which never reads it; drop storage_options, "
            "or pass the checkpoint's store URL."
        )
    is_hub = store is None and is_hub_repo(request.name_or_path, request.hub.subfolder)
    if not is_hub and store is None:
        reject_adapter(request)
    if is_hub:
        # one commit for config, index, headers and weights (every rank uses rank 0's sha)
        request = request.with_revision(pin_revision(request.name_or_path, request.hub.revision, request.hub.as_kwargs()))
    # transformers reads an object store's config from the local copy of its small files
    config_request = request if store is None else replace(request, name_or_path=store.mirror)
    model_class, config, model_kwargs = resolve_class_and_config(config_request)
    reject_quantized(config)
    engine = engine_for(tp_request)
    reject_unknown({k: v for k, v in model_kwargs.items() if k not in init_params(model_class)}, model_class=model_class, config=config)
    if request.attn_implementation is not None:
        hf.set_attn_implementation(config, request.attn_implementation)
    if request.experts_implementation is not None:
        hf.set_experts_implementation(config, request.experts_implementation)

    # 1. resolve: which files, which tensors, where (headers only)
    checkpoint = resolve_checkpoint(request, config, is_hub) if store is None else resolve_stored(request, config, store)
    config, main_dtype = decide_dtype(request, config, checkpoint)
    config.name_or_path = request.name_or_path

    # 2. build on meta, in the engine's context
    with engine.build_context():
        model = build(request, model_class, config, main_dtype, model_kwargs, checkpoint, name_config_errors=engine.names_config_errors)

    # 3. plan (validated before any tensor byte is read), on the skeleton as the engine shards it
    model, shards = engine.shard(model_class, model)
    policy = DtypePolicy.for_model(model, mode=request.dtype_policy, dtype=main_dtype, overrides=request.dtype_overrides)
    mapping = map_checkpoint_keys(model, checkpoint.tensors, key_mapping=request.key_mapping)
    engine.check_servable(request, mapping)
    plan = make_plan(model, checkpoint, mapping, policy, ignore_mismatched_sizes=request.ignore_mismatched_sizes, shards=shards)
    reject_empty_plan(plan, checkpoint, model, request.name_or_path)
    plan = engine.retarget(plan, model)
    if checkpoint.format == CheckpointFormat.DCP:
        dcp.check_complete(model, plan, checkpoint)
    if request.mmap:
        check_mmap(plan, checkpoint_format=checkpoint.format, local=reads_local_files(checkpoint, request.fetch), device=request.device)
    return PreparedLoad(request=request, model=model, checkpoint=checkpoint, plan=plan, policy=policy, mapping=mapping, engine=engine, started=started)


def execute(prepared: PreparedLoad) -> tuple[Any, LoadReport]:
    """Fetch, stream and assign submodule by submodule, finish as transformers does, prove the post-conditions.

    Raises:
        CorruptCheckpointError, RemoteFileChangedError: a file that changed or broke while it was read.
        IncompleteLoadError: a post-condition failed; the model is never returned half-loaded.
    """
    request, model, checkpoint, plan = prepared.request, prepared.model, prepared.checkpoint, prepared.plan
    marks = [prepared.started, time.perf_counter()]

    # 4. fetch: Hub files into the HF cache, or byte ranges straight into memory (the table in fetch/choose.py)
    source = open_source(checkpoint, plan, FetchOptions(
        fetch=request.fetch, cold=prepared.cold, hub=request.hub.as_kwargs(), verify=request.verify_downloads,
        tqdm_class=request.tqdm_class, span_bytes=request.fetch_span_bytes, synchronous=not async_load(),
    ))

    # 5. stream submodule by submodule, assigning each before reading the next
    # as in transformers, a mismatched key is not also missing: it was found, then set aside (and is initialized)
    mismatched = {name for name, _, _ in plan.mismatched_keys}
    loading_info = hf.new_loading_info(
        missing_keys=set(model.state_dict()) - mismatched, unexpected_keys=set(plan.unexpected_keys),
        mismatched_keys=set(plan.mismatched_keys),
    )
    marks.append(time.perf_counter())
    stats, workers, peak_anon = _stream_and_assign(prepared, source, loading_info)
    marks.append(time.perf_counter())

    # 6. finish as transformers does, then prove it
    decisions = _finish(prepared, loading_info, mismatched)
    marks.append(time.perf_counter())

    # 7. report
    report = report_of(
        prepared, model, loading_info=loading_info, decisions=decisions, stats=stats, source=source, workers=workers,
        peak_anon=peak_anon, stage_seconds={stage: end - begin for stage, begin, end in zip(STAGES, marks, marks[1:])},
    )
    model.lowmem_report = report  # what a script that only speaks transformers' API can still inspect
    log_load(type(model).__name__, request.name_or_path, report)
    return model, report


def _stream_and_assign(prepared: PreparedLoad, source: ByteSource, loading_info: Any) -> tuple[StreamStats, int, int]:
    """Stream the plan from ``source`` into the model, assigning each submodule as it arrives; the stream's counters,
    the reader threads it ran and the highest ``RssAnon`` sampled between submodules."""
    request, model, checkpoint, plan = prepared.request, prepared.model, prepared.checkpoint, prepared.plan
    # the bar says "fetching" for bytes that come over the network and for training checkpoints (DCP), "loading"
    # for the weight files of a folder or of the HF cache
    fetched = not reads_local_files(checkpoint, request.fetch)
    bar = byte_bar(
        bytes_to_read(plan), desc="fetching" if fetched or checkpoint.format == CheckpointFormat.DCP else "loading",
        tqdm_class=request.tqdm_class,
    )
    stats = StreamStats(on_read=bar.update if bar is not None else None)
    reader = open_reader(
        checkpoint, plan, source, chunk_bytes=prepared.stream_chunk_bytes, weights_only=request.weights_only,
        mmap=request.mmap, stats=stats,
    )
    peak_anon = proc_status_bytes("RssAnon")
    workers = (source.policy.workers or prepared.workers) if async_load() else 1
    try:
        for _, tensors, staged in stream(
            plan, reader=reader, source=source, device=request.device, stats=stats, workers=workers,
            read_ahead_bytes=request.read_ahead_bytes, read_ahead_hints=prepared.cold,
            into=prepared.engine.destination(model),
        ):
            _assign.assign_submodule(model, tensors, staged, loading_info, in_place=prepared.engine.in_place)
            peak_anon = max(peak_anon, proc_status_bytes("RssAnon"))
    finally:
        if bar is not None:
            bar.close()
    return stats, workers, peak_anon


def _finish(prepared: PreparedLoad, loading_info: Any, mismatched: set[str]) -> dict[str, DtypeDecision]:
    """transformers' finishing steps (tie, buffers, init of what is missing, eval mode, generation config), then the
    post-conditions; the dtype decisions they were checked against."""
    request, model, checkpoint, plan = prepared.request, prepared.model, prepared.checkpoint, prepared.plan
    _assign.finalize(
        model, plan, loading_info, device=request.device, name_or_path=request.name_or_path,
        ignore_mismatched_sizes=request.ignore_mismatched_sizes, device_mesh=hf.device_mesh_of(model),
    )
    _assign.apply_missing_overrides(model, prepared.policy, loading_info.missing_keys | mismatched)
    model.eval()
    model.set_use_kernels(False, None)
    generation_source = generation_config_source(request, checkpoint)
    if model.can_generate() and hasattr(model, "adjust_generation_fn") and generation_source is not None:
        model.adjust_generation_fn(
            request.generation_config, True, None, generation_source, trust_remote_code=request.trust_remote_code,
            **request.hub.as_kwargs(),
        )
    decisions = decisions_of(plan)
    _assign.check_loaded(model, decisions, request.device)
    return decisions


def load(request: LoadRequest):
    """``prepare`` + ``execute``; returns what transformers' ``from_pretrained`` returns for the request."""
    model, report = execute(prepare(request))
    return (model, report) if request.output_loading_info else model
