"""The recipe, in two halves: ``prepare`` (resolve, build on meta, plan: no tensor byte) and ``execute``.

    prepared = prepare(request)     # one pinned revision, headers only, the skeleton, this rank's plan
    model, report = execute(prepared)   # fetch, stream submodule by submodule, assign, finalize, prove

``from_pretrained`` is both; a dry run (``lowmem-hf plan``) is ``prepare`` alone. Everything model-specific
(config classes, key renames, dtype rules, init, tying) is transformers' own.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import math
import os
import re
import time
import traceback
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

import torch
import torch.distributed as dist
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module, resolve_trust_remote_code
from transformers.utils import CONFIG_NAME

from . import assign as _assign
from .compat import transformers_api as hf
from .distributed import Engine, engine_for
from .distributed import zero3 as _zero3
from .distributed.tp import TPRequest, request_tp
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    LowMemError,
    NothingToLoadError,
    UnsupportedArgumentError,
    short_repr,
)
from .fetch import fetch_files
from .formats import StreamStats, dcp, open_reader
from .formats.safetensors import check_mmap
from .hub import pin_revision, resolve_hub
from .logs import log_load
from .plan import DtypePolicy, KeyMapping, build_on_meta, make_plan, map_checkpoint_keys
from .plan.dtypes import FLOAT_DTYPES
from .estimate import PlanEstimate, bytes_to_read, estimate_plan
from .plan.planner import decisions_of
from .progress import byte_bar
from .request import NOT_IMPLEMENTED, LoadRequest, make_request
from .resolve import resolve_dcp, resolve_local
from .settings import async_load, proc_status_bytes
from .sources.exchange import CooperativeRanges
from .sources.http import HttpRanges
from .sources.local import GAP_BYTES, LocalFiles, cached_fraction
from .stream import choose_workers, staging_chunk_bytes, stream
from .types import Checkpoint, CheckpointFormat, LoadPlan, LoadReport

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
        """The stream's chunk size: the requested one for HTTP ranges and DCP chunks, else capped so staging
        stays small next to what this rank loads (``staging_chunk_bytes``)."""
        checkpoint = self.checkpoint
        if not _reads_local_files(self.request, checkpoint) or checkpoint.format == CheckpointFormat.DCP:
            return self.request.chunk_bytes
        return staging_chunk_bytes(self.plan, self.request.chunk_bytes, self.workers)

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
        """Files mostly not in the page cache: the stream then announces its reads ahead to the kernel."""
        return self.page_cache_fraction is not None and self.page_cache_fraction < 0.9

    def estimate(self) -> PlanEstimate:
        """What ``execute`` will read, download and hold on this rank (the dry run's numbers)."""
        return estimate_plan(
            self.model, self.plan, self.checkpoint,
            rank=self.engine.rank,
            chunk_bytes=self.stream_chunk_bytes, workers=self.workers,
            cached=self.checkpoint.local_paths, fetch=self.request.fetch,
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
    is_hub = _is_hub_repo(request.name_or_path, request.hub.subfolder)
    if not is_hub:
        _reject_adapter(request)
    if is_hub:
        # one commit for config, index, headers and weights (every rank uses rank 0's sha)
        request = request.with_revision(pin_revision(request.name_or_path, request.hub.revision, request.hub.as_kwargs()))
    model_class, config, model_kwargs = _resolve_class_and_config(request)
    _reject_quantized(config)
    engine = engine_for(tp_request)
    _reject_unknown({k: v for k, v in model_kwargs.items() if k not in _init_params(model_class)}, model_class=model_class, config=config)
    if request.attn_implementation is not None:
        hf.set_attn_implementation(config, request.attn_implementation)
    if request.experts_implementation is not None:
        hf.set_experts_implementation(config, request.experts_implementation)

    # 1. resolve: which files, which tensors, where (headers only)
    checkpoint = _resolve_checkpoint(request, config, is_hub)
    config, main_dtype = _decide_dtype(request, config, checkpoint)
    config.name_or_path = request.name_or_path

    # 2. build on meta, in the engine's context
    with engine.build_context():
        model = _build(request, model_class, config, main_dtype, model_kwargs, checkpoint)

    # 3. plan (validated before any tensor byte is read), on the skeleton as the engine shards it
    model, shards = engine.shard(model_class, model)
    policy = DtypePolicy.for_model(model, mode=request.dtype_policy, dtype=main_dtype, overrides=request.dtype_overrides)
    mapping = map_checkpoint_keys(model, checkpoint.tensors, key_mapping=request.key_mapping)
    engine.check_servable(request, mapping)
    plan = make_plan(model, checkpoint, mapping, policy, ignore_mismatched_sizes=request.ignore_mismatched_sizes, shards=shards)
    _reject_empty_plan(plan, checkpoint, model, request.name_or_path)
    plan = engine.retarget(plan, model)
    if checkpoint.format == CheckpointFormat.DCP:
        dcp.check_complete(model, plan, checkpoint)
    if request.mmap:
        check_mmap(plan, checkpoint_format=checkpoint.format, local=_reads_local_files(request, checkpoint), device=request.device)
    return PreparedLoad(request=request, model=model, checkpoint=checkpoint, plan=plan, policy=policy, mapping=mapping, engine=engine, started=started)


def _reads_local_files(request: LoadRequest, checkpoint) -> bool:
    """False when the tensor bytes come over HTTP ranges into memory (``fetch='ranges'``), never into a local file."""
    return not (checkpoint.remote and request.fetch == "ranges" and checkpoint.format == CheckpointFormat.SAFETENSORS)


def execute(prepared: PreparedLoad) -> tuple[Any, LoadReport]:
    """Fetch, stream and assign submodule by submodule, finish as transformers does, prove the post-conditions.

    Raises:
        CorruptCheckpointError, RemoteFileChangedError: a file that changed or broke while it was read.
        IncompleteLoadError: a post-condition failed; the model is never returned half-loaded.
    """
    request, model, checkpoint, plan = prepared.request, prepared.model, prepared.checkpoint, prepared.plan
    hub = request.hub.as_kwargs()

    # 4. fetch: Hub files into the HF cache, or byte ranges straight into memory
    fetched = not _reads_local_files(request, checkpoint)
    if not fetched:
        paths = checkpoint.local_paths
        if checkpoint.repo_id is not None:
            paths = fetch_files(checkpoint, plan.files, hub, verify=request.verify_downloads, tqdm_class=request.tqdm_class)
        source = LocalFiles(paths, gap_bytes=0 if prepared.cold else GAP_BYTES, planned=checkpoint.identities)
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # under a process group the ranks fetch together: each byte once, in large spans (sources/exchange.py)
        source = CooperativeRanges(
            checkpoint.remote, plan, token=request.hub.token, local=checkpoint.local_paths,
            span_bytes=request.fetch_span_bytes, synchronous=not async_load(),
        )
    else:
        source = HttpRanges(checkpoint.remote, token=request.hub.token, local=checkpoint.local_paths)

    # 5. stream submodule by submodule, assigning each before reading the next
    # as in transformers, a mismatched key is not also missing: it was found, then set aside (and is initialized)
    mismatched = {name for name, _, _ in plan.mismatched_keys}
    loading_info = hf.new_loading_info(
        missing_keys=set(model.state_dict()) - mismatched, unexpected_keys=set(plan.unexpected_keys),
        mismatched_keys=set(plan.mismatched_keys),
    )
    # "fetching" for bytes over the network; DCP loads have always said it too (a slip this refactor keeps)
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
    workers = (source.workers or prepared.workers) if async_load() else 1
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

    # 6. finish as transformers does, then prove it
    _assign.finalize(
        model, plan, loading_info, device=request.device, name_or_path=request.name_or_path,
        ignore_mismatched_sizes=request.ignore_mismatched_sizes, device_mesh=hf.device_mesh_of(model),
    )
    _assign.apply_missing_overrides(model, prepared.policy, loading_info.missing_keys | mismatched)
    model.eval()
    model.set_use_kernels(False, None)
    generation_source = _generation_config_source(request, checkpoint)
    if model.can_generate() and hasattr(model, "adjust_generation_fn") and generation_source is not None:
        model.adjust_generation_fn(
            request.generation_config, True, None, generation_source, trust_remote_code=request.trust_remote_code, **hub
        )
    decisions = decisions_of(plan)
    _assign.check_loaded(model, decisions, request.device)

    if stats.band_extra_bytes:
        stats.notes.append(
            f"fetch='ranges': slices along dim 1 were fetched as whole row bands, one request per band instead of one "
            f"per row; that cost {stats.band_extra_bytes} bytes beyond the slices ({stats.band_extra_bytes / 2**20:.1f} MiB)."
        )
    notes = list(stats.notes) + [
        f"{src} duplicates {dst}; transformers keeps the first, so it was not read" for src, dst in prepared.mapping.duplicates
    ]
    notes += prepared.engine.notes()
    report = LoadReport(
        missing_keys=frozenset(loading_info.missing_keys),
        unexpected_keys=frozenset(loading_info.unexpected_keys),
        mismatched_keys=frozenset(loading_info.mismatched_keys),
        error_msgs=tuple(loading_info.error_msgs),
        checkpoint_format=checkpoint.format,
        files_read=tuple(stats.files_read),
        bytes_read=stats.bytes_read + checkpoint.header_bytes + stats.header_bytes,
        header_bytes=checkpoint.header_bytes + stats.header_bytes,
        dtype=plan.dtype,
        dtype_policy=request.dtype_policy,
        dtype_decisions=decisions,
        model_bytes=_assign.model_nbytes(model),
        staging_bytes=stats.staging_bytes,
        wall_seconds=time.perf_counter() - prepared.started,
        peak_rss_anon_bytes=max(peak_anon, proc_status_bytes("RssAnon")),
        peak_vm_hwm_bytes=proc_status_bytes("VmHWM"),
        notes=tuple(notes),
        shards=dict(plan.shards),
        commit=checkpoint.commit,
        mapped_bytes=stats.mapped_bytes,
        gap_bytes=source.gap_bytes_read,
        reader_workers=workers,
        chunk_bytes=prepared.stream_chunk_bytes,
        page_cache_fraction=prepared.page_cache_fraction,
        requests=source.requests,
        bytes_fetched=source.bytes_fetched,
        bytes_received=source.bytes_received,
    )
    model.lowmem_report = report  # what a script that only speaks transformers' API can still inspect
    log_load(type(model).__name__, request.name_or_path, report)
    return model, report


def _generation_config_source(request: LoadRequest, checkpoint: Checkpoint) -> str | None:
    """Where transformers' ``adjust_generation_fn`` looks for ``generation_config.json`` (then ``config.json``).

    The checkpoint's folder, as in transformers, except for a training checkpoint that holds neither file
    (``dcp.save`` writes only ``.metadata`` and ``*.distcp``): then the folder of ``config=`` when it is a path, or
    None when it is a config object, whose model already built its generation config from the config at
    ``__init__``, exactly as transformers builds one when no file has it.
    """
    if request.generation_config is not None or checkpoint.format != CheckpointFormat.DCP:
        return request.name_or_path
    folder = os.path.join(request.name_or_path, request.hub.subfolder)
    if any(os.path.isfile(os.path.join(folder, name)) for name in ("generation_config.json", "config.json")):
        return request.name_or_path
    if isinstance(request.config, (str, os.PathLike)):
        config_path = os.fspath(request.config)
        return os.path.dirname(config_path) if os.path.isfile(config_path) else config_path
    return None


def load(request: LoadRequest):
    """``prepare`` + ``execute``; returns what transformers' ``from_pretrained`` returns for the request."""
    model, report = execute(prepare(request))
    return (model, report) if request.output_loading_info else model


def _resolve_checkpoint(request: LoadRequest, config: Any, is_hub: bool) -> Checkpoint:
    selection = dict(
        variant=request.variant,
        use_safetensors=request.use_safetensors,
        explicit_filename=getattr(config, "transformers_weights", None),
        weights_only=request.weights_only,
    )
    if not is_hub and (request.checkpoint_format == "dcp" or dcp.is_dcp_dir(os.path.join(request.name_or_path, request.hub.subfolder))):
        return resolve_dcp(request.name_or_path, subfolder=request.hub.subfolder)
    if is_hub:
        return resolve_hub(
            request.name_or_path, commit=request.hub.revision, hub=request.hub.as_kwargs(), verify=request.verify_downloads, **selection
        )
    return resolve_local(request.name_or_path, subfolder=request.hub.subfolder, **selection)


def _decide_dtype(request: LoadRequest, config: Any, checkpoint: Checkpoint) -> tuple[Any, torch.dtype]:
    """transformers' own dtype decision: the declared dtype (``"auto"``: config, else the first file's tensors).

    Raises:
        ValueError: ``"auto"`` chose a dtype transformers cannot build a model in (a float8 checkpoint whose
            config.json names float8 or no dtype): transformers fails on it with a raw ``TypeError`` about a storage
            class while building the model.
    """
    declared = getattr(config, "dtype", None)
    config, dtype = _get_dtype_as_transformers(request, config, checkpoint)
    if dtype not in FLOAT_DTYPES:
        if declared is not None:
            origin = f"the config's dtype ({_config_source(request) or 'config='}: dtype={str(declared).removeprefix('torch.')!r})"
        else:
            first = next((i for i in checkpoint.tensors.values() if i.file == checkpoint.files[0] and i.dtype == dtype), None)
            origin = f"the stored dtype of the first floating tensor in {checkpoint.files[0]}" + (f" ({first.key!r})" if first else "")
        raise ValueError(
            f"dtype={short_repr(request.dtype or 'auto')} chose {dtype}, {origin}: transformers builds models only in "
            f"{', '.join(str(d) for d in FLOAT_DTYPES)} (its own from_pretrained fails on {dtype} with a TypeError while "
            "building the model). Pass dtype=torch.bfloat16 (or another of those) to cast the stored tensors to it, "
            "as transformers does with that argument."
        )
    return config, dtype


def _get_dtype_as_transformers(request: LoadRequest, config: Any, checkpoint: Checkpoint) -> tuple[Any, torch.dtype]:
    sharded_metadata = dict(checkpoint.index_metadata) if checkpoint.index_metadata is not None else None
    local_files = [checkpoint.local_paths.get(f, f) for f in checkpoint.files]
    if checkpoint.format != CheckpointFormat.DCP and all(os.path.isfile(f) for f in local_files):
        return hf.decide_dtype(request.dtype, local_files, config, sharded_metadata, None, request.weights_only)
    # transformers infers "auto" from the first file's tensors; the remote headers already say what they are
    first = [i for i in checkpoint.tensors.values() if i.file == checkpoint.files[0]]
    meta_state = {i.key: torch.empty(0, dtype=i.dtype, device="meta") for i in first}
    return hf.decide_dtype(request.dtype, None, config, sharded_metadata, meta_state, request.weights_only)


def _resolve_class_and_config(request: LoadRequest) -> tuple[type, Any, dict[str, Any]]:
    """transformers' routing: load the config (applying overrides), pick the model class.

    An auto class routes on the config (remote code included); a concrete class loads its own
    ``config_class`` and is the model class, exactly as ``PreTrainedModel.from_pretrained`` does.
    """
    target, path, config = request.target, request.name_or_path, request.config
    hub = request.hub.as_kwargs()
    overrides = dict(request.config_overrides)
    if not hf.is_auto_class(target):
        if not isinstance(config, PreTrainedConfig):
            if target.config_class is None:
                raise ValueError(f"{target.__name__} does not define `config_class`; pass an explicit config.")
            config, model_kwargs = _load_config(
                request,
                lambda: target.config_class.from_pretrained(
                    config if config is not None else path, return_unused_kwargs=True, **hub, **overrides
                ),
            )
        else:
            config, model_kwargs = copy.deepcopy(config), overrides
        return target, config, model_kwargs

    if not isinstance(config, PreTrainedConfig):
        config, model_kwargs = _load_config(
            request,
            lambda: AutoConfig.from_pretrained(
                config if config is not None else path,
                return_unused_kwargs=True,
                trust_remote_code=request.trust_remote_code,
                code_revision=request.code_revision,
                **hub,
                **overrides,
            ),
        )
    else:
        config, model_kwargs = copy.deepcopy(config), overrides

    trust_remote_code = request.trust_remote_code
    has_remote_code = hasattr(config, "auto_map") and target.__name__ in config.auto_map
    has_local_code = type(config) in hf.auto_model_mapping(target)
    if has_remote_code:
        class_ref = config.auto_map[target.__name__]
        upstream = class_ref.split("--")[0] if "--" in class_ref else None
        trust_remote_code = resolve_trust_remote_code(
            trust_remote_code, path, has_local_code, has_remote_code, upstream_repo=upstream
        )
    if has_remote_code and trust_remote_code:
        model_class = get_class_from_dynamic_module(class_ref, path, code_revision=request.code_revision, **hub)
    elif has_local_code:
        model_class = hf.model_class_for(config, target)
        text_config_class = config.sub_configs.get("text_config", None)
        if text_config_class is not None and getattr(model_class, "config_class", None) == text_config_class:
            config = config.get_text_config()
    else:
        raise ValueError(
            f"{type(config).__name__} (model_type={config.model_type!r}) has no model for {target.__name__}. "
            f"Its model types are: {', '.join(sorted(c.model_type for c in hf.auto_model_mapping(target).keys() if hasattr(c, 'model_type')))}."
        )
    return model_class, config, model_kwargs


def _load_config(request: LoadRequest, load: Callable[[], tuple[Any, dict[str, Any]]]) -> tuple[Any, dict[str, Any]]:
    """``load()`` (transformers' config loading), its errors about values wrapped into a ``ValueError`` that names the
    config file and the field: transformers lets a ``KeyError`` (rope validation), a ``ZeroDivisionError`` (0 heads)
    or a strict-dataclass validation error out as they are. Errors about files (``OSError``) and missing packages
    (``ImportError``) pass unchanged: they already say what is missing."""
    try:
        return load()
    except OSError as e:
        cause = e.__context__
        if isinstance(cause, (json.JSONDecodeError, UnicodeDecodeError)):
            # transformers' "is not a valid JSON file" says neither where nor why; an OSError still, as transformers'
            raise CorruptCheckpointError(
                f"{_config_source(request) or CONFIG_NAME} is not a valid JSON file: {type(cause).__name__}: {cause}. "
                "Fix the file (it must be UTF-8 JSON holding one object), or pass a valid config=."
            ) from e
        missing = _missing_config(request.config, e)
        if missing is not None:
            raise missing from e
        raise
    except ImportError:
        raise
    except Exception as e:
        source = _config_source(request)
        if source is None:
            # a local folder with no config.json: transformers' "Unrecognized model in ..." (kept, it is what callers
            # match), plus where it looked: its message names neither the subfolder nor the file
            where = os.path.join(os.fspath(request.config) if request.config is not None else request.name_or_path, request.hub.subfolder)
            raise ValueError(
                f"{' '.join(str(e).split())} There is no {CONFIG_NAME} in {os.path.abspath(where)}"
                + (f" (subfolder={request.hub.subfolder!r})" if request.hub.subfolder else "")
                + ": pass the folder save_pretrained wrote, or config=."
            ) from e
        raise ValueError(_config_error_message(e, source, request)) from e


def _missing_config(config: Any, e: OSError) -> CheckpointNotFoundError | None:
    """The error for a ``config=`` path that is no local folder or file, which transformers could not load as a Hub
    repo id either (its error speaks of connecting to the Hub and names neither the argument nor the path); None for
    any other ``config``."""
    if not isinstance(config, (str, os.PathLike)) or os.path.exists(config):
        return None
    path, fix = os.fspath(config), "Check the path, or pass a transformers config object."
    found = f"no such local path, and as a Hub repo id: {' '.join(str(e).split()).rstrip('.')}"
    return CheckpointNotFoundError(
        f"config={short_repr(path)} names no local folder or file and no Hub repo that could be loaded ({found}). {fix}",
        key="config", file=path, expected="a local folder or config.json, or a Hub repo id", found=found, fix=fix,
    )


def _build(
    request: LoadRequest, model_class: type, config: Any, dtype: torch.dtype, model_kwargs: dict[str, Any], checkpoint: Checkpoint
):
    """``build_on_meta``, with the errors transformers' model code raises on nonsense config values (a ``KeyError``
    for an unknown ``rope_type``, a ``ZeroDivisionError`` for ``num_key_value_heads=0``, torch's ``RuntimeError`` for
    a negative size) wrapped into a ``ValueError`` naming the config file and the fields, as ``_load_config`` does;
    and a model vastly larger than the checkpoint refused while it is built (``_oversized``)."""
    stored = sum(math.prod(info.shape) for info in checkpoint.tensors.values())
    try:
        return build_on_meta(
            model_class, config, dtype, request.model_args, model_kwargs,
            max_numel=max(OVERSIZE_FACTOR * stored, OVERSIZE_FLOOR),
            describe=lambda built: _oversized(request, config, checkpoint, stored, built),
        )
    except (KeyError, IndexError, ZeroDivisionError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        if isinstance(e, LowMemError) or _zero3.zero3_enabled():
            raise
        if isinstance(request.config, PreTrainedConfig):
            source, values = "the config passed as config=", request.config.to_dict()
        else:
            source, values = _config_source(request), None
            if source is None:
                raise
        raise ValueError(
            _config_error_message(e, source, request, what=f"{model_class.__name__}", values=values)
        ) from e


OVERSIZE_FACTOR = 1000
OVERSIZE_FLOOR = 10**8
"""A model is refused while it is built on meta once its parameters pass both ``OVERSIZE_FACTOR`` times the elements
the checkpoint stores and ``OVERSIZE_FLOOR`` elements: no checkpoint fills 0.1% of its model, and a config value off
by orders of magnitude would otherwise build modules for hours (transformers' own from_pretrained never returns)."""


def _oversized(request: LoadRequest, config: Any, checkpoint: Checkpoint, stored: int, built: int) -> str:
    biggest = max((d for info in checkpoint.tensors.values() for d in info.shape), default=0)
    suspects = [
        f"{k}={v}" for k, v in sorted(config.to_dict().items())
        if isinstance(v, int) and not isinstance(v, bool) and v > biggest
    ]
    return (
        f"{_config_source(request) or 'the config'} builds a model that already has {built:,} parameters, over "
        f"{OVERSIZE_FACTOR}x the {stored:,} elements the checkpoint {checkpoint.name_or_path} stores: a size in the "
        f"config is off" + (f" ({', '.join(suspects)}: larger than any dimension the checkpoint stores)" if suspects else "")
        + ". Fix the config (or pass a config that matches the weights)."
    )


def _config_source(request: LoadRequest) -> str | None:
    """The config file transformers read: a local file, or a description of the Hub repo's; None if there is none."""
    config, subfolder = request.config, request.hub.subfolder
    source = os.fspath(config) if config is not None else request.name_or_path
    if os.path.isdir(source):
        source = os.path.join(source, subfolder, CONFIG_NAME)
        return source if os.path.isfile(source) else None
    if os.path.isfile(source):
        return source
    return f"{CONFIG_NAME} of the Hub repo {source!r}" + (f" (subfolder {subfolder!r})" if subfolder else "")


def _config_error_message(
    error: Exception, source: str, request: LoadRequest, *, what: str = "a config", values: dict[str, Any] | None = None
) -> str:
    """``transformers could not build <what> from <source>: <error> [field: name=value]. <fix>``; ``values``: the
    config's fields (default: read from ``source`` when it is a file)."""
    values = dict(values or {})
    if not values and os.path.isfile(source):
        try:
            with open(source, encoding="utf-8") as f:
                values = dict(json.load(f))
        except (OSError, ValueError, TypeError):
            pass
    overrides = dict(request.config_overrides)
    fields = _fields_named(error, set(values) | set(overrides), values={**values, **overrides})
    named = "; ".join(
        f"{name}={short_repr(overrides[name])} (the keyword argument)" if name in overrides else f"{name}={short_repr(values[name])}"
        for name in fields
    )
    return (
        f"transformers could not build {what} from {source}: {type(error).__name__}: {' '.join(str(error).split()).rstrip('.')}"
        + (f" [field: {named}]" if named else "")
        + ". Fix the value in that file (or the keyword argument), or pass a valid config=."
    )


def _fields_named(error: Exception, keys: set[str], values: dict[str, Any] | None = None) -> list[str]:
    """The config fields an error from transformers' config code is about: the field of a strict-dataclass error,
    else the config keys its message names, else those named in the code line that raised (``self.hidden_size %
    self.num_attention_heads``), searched from the innermost frame out."""
    text = str(error)
    field = re.search(r"field '(\w+)'", text)
    if field:
        return [field.group(1)]
    named = [k for k in dict.fromkeys(re.findall(r"\w+", text)) if k in keys]
    if named:
        return named
    if isinstance(error, KeyError) and values is not None:
        # a value used as a key (rope_type='nonsense'): the fields whose value holds it
        missing = {str(a) for a in error.args}
        named = [k for k in sorted(keys) if k in values and missing & set(re.findall(r"[\w.-]+", repr(values[k])))]
        if named:
            return named
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        named = [k for k in dict.fromkeys(re.findall(r"\w+", frame.line or "")) if k in keys]
        if named:
            return named
    return []



def _init_params(model_class: type) -> set[str]:
    """Keyword parameters ``model_class.__init__`` names explicitly (where unknown kwargs may legitimately go)."""
    params = inspect.signature(model_class.__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "config") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _reject_unknown(unknown: dict[str, Any], *, model_class: type, config: Any) -> None:
    if not unknown:
        return
    valid = set(inspect.signature(make_request).parameters) | set(NOT_IMPLEMENTED)
    properties = {n for n in dir(type(config)) if isinstance(getattr(type(config), n, None), property) and not n.startswith("_")}
    valid |= set(config.to_dict()) | properties | _init_params(model_class)
    messages = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, sorted(valid), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        messages.append(f"{name!r}{hint}")
    raise TypeError(
        f"from_pretrained got unexpected keyword argument(s) {', '.join(messages)}. Keywords must be "
        f"from_pretrained arguments, attributes of {type(config).__name__} (to override the config), or "
        f"arguments of {model_class.__name__}.__init__."
    )


def _reject_quantized(config: Any) -> None:
    """A quantized checkpoint needs transformers' quantizers, which lowmem_hf does not implement."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", "?")
        raise UnsupportedArgumentError(
            "quantization_config",
            f"the checkpoint's config.json has a quantization_config (quant_method={method!r}); quantized "
            "checkpoints are not supported by lowmem_hf: load them with transformers' from_pretrained.",
        )


def _reject_empty_plan(plan: LoadPlan, checkpoint: Checkpoint, model: Any, path: str) -> None:
    """A checkpoint none of whose tensors loads gives a fully re-initialized model: that is never a load, whatever
    ``ignore_mismatched_sizes`` says (it turns mismatches into re-initialized tensors one by one)."""
    if not checkpoint.tensors or plan.reads_per_file():
        return
    examples = sorted(checkpoint.tensors)[:3]
    raise NothingToLoadError(
        f"Not one of the {len(checkpoint.tensors)} tensors in {path} loads into {type(model).__name__}: "
        f"{len(plan.mismatched_keys)} have another shape than the model's parameter (ignored with "
        f"ignore_mismatched_sizes=True), {len(plan.unexpected_keys)} match no parameter (e.g. {examples}). "
        "The checkpoint does not belong to this model: check the path, the auto class and the config "
        "(keyword overrides such as vocab_size=... change the shapes)."
    )


def _reject_adapter(request: LoadRequest) -> None:
    """A folder holding a PEFT adapter makes transformers load its base model and attach the adapter (when peft
    is installed); lowmem_hf does not, so such a call is handed to transformers rather than loading the base alone.

    Local folders only: for a Hub repo the check costs a request per load, and the cooperative fetch's request
    bound is a tested contract; a Hub adapter repo has no ``config.json`` and fails to resolve anyway.
    """
    from transformers.utils import find_adapter_config_file, is_peft_available

    if not is_peft_available():
        return
    found = find_adapter_config_file(request.name_or_path, subfolder=request.hub.subfolder, local_files_only=True)
    if found is not None:
        raise UnsupportedArgumentError(
            "adapter",
            f"{found} is a PEFT adapter; transformers loads its base model and attaches the adapter, which lowmem_hf "
            "does not do. Load the base with lowmem_hf, then the adapter with peft's PeftModel.from_pretrained.",
        )


def _is_hub_repo(path: str, subfolder: str) -> bool:
    """A local folder is loaded from disk; anything else must be a valid Hub repo id (else: not found)."""
    if os.path.isdir(os.path.join(path, subfolder)) or os.path.isdir(path):
        return False
    try:
        validate_repo_id(path)
    except HFValidationError:
        raise CheckpointNotFoundError(
            f"{path!r} is neither a local folder nor a Hub repo id ('org/name'). Check the path."
        ) from None
    return True
