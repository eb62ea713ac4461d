"""``LowMemAutoModel*``: drop-in ``AutoModel*.from_pretrained`` that streams weights into a meta-built model.

The recipe (``_load``) reads top to bottom: resolve -> build on meta -> plan -> stream + assign -> finalize.
Everything model-specific (config classes, key renames, dtype rules, init, tying) is transformers' own.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import os
import time
from typing import Any

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, PreTrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import get_class_from_dynamic_module, resolve_trust_remote_code
from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass, _get_model_class
from transformers.modeling_utils import _get_dtype
from transformers.utils.loading_report import LoadStateDictInfo

from . import assign as _assign
from .errors import CheckpointNotFoundError
from .plan import DtypePolicy, build_on_meta, make_plan, map_checkpoint_keys, parse_dtype
from .plan.planner import decisions_of
from .fetch import FETCH_MODES, HttpRanges, fetch_files
from .hub import pin_revision, resolve_hub
from .resolve import resolve_local
from .stream import DEFAULT_CHUNK_BYTES, StreamStats, stream
from .tensor_parallel import distribute, plan_shards, request_tp
from .types import CheckpointFormat, LoadReport

__all__ = ["LowMemAutoModelBase", "AUTO_CLASSES"]

# transformers' documented from_pretrained arguments whose behaviour lowmem_hf does not implement. Each raises
# NotImplementedError naming it, rather than being silently dropped.
_NOT_IMPLEMENTED = {
    "state_dict": "pass a folder saved with save_pretrained instead",
    "quantization_config": "quantized loading is not supported; load in a float dtype",
    "gguf_file": "GGUF files are not supported; convert to safetensors",
    "max_memory": "lowmem_hf places the whole model on one device",
    "offload_folder": "disk offload is not supported",
    "offload_buffers": "disk offload is not supported",
    "offload_state_dict": "disk offload is not supported",
    "distributed_config": "pass tp_plan / tp_size (tensor parallelism only; FSDP, pipeline and expert parallelism are not supported)",
    "adapter_kwargs": "PEFT adapters are not supported; load the base model, then attach the adapter with peft",
    "adapter_name": "PEFT adapters are not supported; load the base model, then attach the adapter with peft",
    "use_kernels": "hub kernels are not supported",
    "kernel_config": "hub kernels are not supported",
    "allow_all_kernels": "hub kernels are not supported",
    "fusion_config": "fusion patches are not supported",
    "tqdm_class": "lowmem_hf shows no progress bar",
    "from_tf": "TensorFlow checkpoints are not supported",
    "from_flax": "Flax checkpoints are not supported",
    "mirror": "mirrors are not supported",
}

_HUB_ARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token")


def _single_device(device: Any, device_map: Any) -> torch.device:
    """The one device the model goes to, from ``device`` and/or a single-device ``device_map``."""
    if device_map is not None:
        if isinstance(device_map, dict):
            values = set(str(torch.device(v) if isinstance(v, int) else v) for v in device_map.values())
            if len(values) != 1:
                raise NotImplementedError(
                    f"device_map={device_map!r} spreads the model over {sorted(values)}; lowmem_hf places the "
                    "whole model on one device. Pass device='cuda:0' (or a one-device map like {'': 0})."
                )
            (mapped,) = values
        elif isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise NotImplementedError(
                f"device_map={device_map!r} dispatches the model across devices, which lowmem_hf does not do. "
                "Pass one device, e.g. device_map='cuda:0' or device='cpu'."
            )
        else:
            mapped = device_map
        if mapped == "disk":
            raise NotImplementedError("device_map='disk' (disk offload) is not supported; load to 'cpu'.")
        mapped = torch.device(f"cuda:{mapped}" if isinstance(mapped, int) else mapped)
        if device is not None and torch.device(device) != mapped:
            raise ValueError(f"device={device!r} and device_map={device_map!r} disagree; pass one of them.")
        return mapped
    return torch.device(device if device is not None else "cpu")


def _init_params(model_class: type) -> set[str]:
    """Keyword parameters ``model_class.__init__`` names explicitly (where unknown kwargs may legitimately go)."""
    params = inspect.signature(model_class.__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "config") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _reject_unknown(unknown: dict[str, Any], *, model_class: type, config: Any) -> None:
    if not unknown:
        return
    valid = set(inspect.signature(LowMemAutoModelBase.from_pretrained).parameters) | set(_NOT_IMPLEMENTED)
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


def _proc_status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class LowMemAutoModelBase:
    """Base of every ``LowMemAutoModel*`` class; ``_auto_class`` is the transformers auto class it stands in for."""

    _auto_class: type = None  # type: ignore[assignment]

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(f"{type(self).__name__} is not instantiable; use {type(self).__name__}.from_pretrained(...)")

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *model_args: Any,
        torch_dtype: Any = None,
        dtype: Any = None,
        dtype_policy: str = "declared",
        dtype_overrides: Any = None,
        device: str | torch.device | None = None,
        device_map: Any = None,
        config: PreTrainedConfig | str | os.PathLike | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        force_download: bool = False,
        proxies: dict | None = None,
        subfolder: str = "",
        variant: str | None = None,
        use_safetensors: bool | None = None,
        weights_only: bool = True,
        trust_remote_code: bool | None = None,
        code_revision: str | None = None,
        attn_implementation: str | dict | None = None,
        experts_implementation: str | None = None,
        ignore_mismatched_sizes: bool = False,
        key_mapping: dict[str, str] | None = None,
        generation_config: Any = None,
        output_loading_info: bool = False,
        low_cpu_mem_usage: bool | None = None,
        disable_mmap: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        fetch: str = "files",
        tp_plan: str | dict | None = None,
        tp_size: int | None = None,
        tp_rank: int | None = None,
        device_mesh: Any = None,
        **config_overrides: Any,
    ):
        """Load a pretrained model like ``transformers.AutoModel*.from_pretrained``, at ~1.0x its size in memory.

        Args:
            pretrained_model_name_or_path: a local folder saved with ``save_pretrained``, or a Hub repo id.
            *model_args: passed to the model's ``__init__``, as in transformers.
            torch_dtype: the declared dtype: a ``torch.dtype``, its name, or ``"auto"``/``None`` for the
                config's dtype (else the checkpoint's), exactly as transformers 5 decides it.
            dtype: transformers 5's name for ``torch_dtype``; pass one of the two.
            dtype_policy: ``"declared"`` (every tensor gets the declared dtype, unless the model keeps it in
                fp32 or builds it in another dtype, as in transformers) or ``"loaded"`` (every tensor keeps
                its checkpoint dtype). See ``lowmem_hf.plan.dtypes``.
            dtype_overrides: ordered ``{glob: dtype}`` (or list of pairs) that beats the policy, first match wins,
                e.g. ``{"*.norm.weight": torch.float32}``.
            device: where the parameters go (default ``"cpu"``).
            device_map: transformers' spelling of ``device``; only a single device is supported.
            config: a config object or a path to one, instead of the folder's ``config.json``.
            revision, cache_dir, local_files_only, token, force_download, proxies, code_revision:
                forwarded to transformers' config and remote-code loading.
            subfolder, variant, use_safetensors: which weight files, as in transformers.
            weights_only: restrict ``.bin`` unpickling to tensors (default). Pass ``False`` only for files you trust.
            trust_remote_code: allow the config's ``auto_map`` model code, as in transformers.
            attn_implementation, experts_implementation: as in transformers.
            ignore_mismatched_sizes: initialize (instead of failing on) parameters whose stored shape differs.
            key_mapping: ``{regex: replacement}`` renames applied to checkpoint keys before transformers' own.
            generation_config: a ``GenerationConfig`` to use instead of the folder's ``generation_config.json``.
            output_loading_info: also return the ``LoadReport``.
            low_cpu_mem_usage: accepted for compatibility; lowmem_hf always streams (transformers 5 ignores it too).
            disable_mmap: accepted for compatibility; lowmem_hf never memory-maps safetensors.
            chunk_bytes: the staging chunk size for dtype conversion and device copies.
            tp_plan: tensor parallelism: ``"auto"`` (the model's own plan: ``_tp_plan`` merged with
                ``config.base_model_tp_plan``) or a dict of rules overriding it. Under a process group (or
                torchrun) the model is sharded by transformers' TP engine and each rank reads only its slices;
                see ``lowmem_hf.tensor_parallel``.
            tp_size, tp_rank: default to the process group's. Without a group, both given: load only rank
                ``tp_rank``'s slices as plain tensors (no TP forward); ``LoadReport.shards`` describes them.
            device_mesh: a 1-D tp mesh; its size must equal ``tp_size``.
            fetch: for Hub repos: ``"files"`` downloads into the HF cache only the shard files this rank's plan
                touches; ``"ranges"`` fetches only the planned byte ranges into memory and writes no shard to
                disk (safetensors only; ``.bin`` shards are always fetched whole). Ignored for local folders.
            **config_overrides: config attributes to override (``num_labels=3``), or arguments of the model's
                ``__init__``, exactly as transformers routes them.

        Returns:
            The model in eval mode, or ``(model, LoadReport)`` with ``output_loading_info=True``.

        Raises:
            TypeError: an unknown keyword (names the closest valid one).
            NotImplementedError: a transformers argument lowmem_hf does not implement (names it).
            ValueError: a bad dtype, dtype policy or device combination.
            OSError: a missing or corrupt checkpoint (see ``lowmem_hf.errors``).

        Example:
            >>> model = LowMemAutoModelForCausalLM.from_pretrained("./my-llama", torch_dtype=torch.bfloat16)
        """
        for name in [n for n in config_overrides if n in _NOT_IMPLEMENTED]:
            raise NotImplementedError(f"from_pretrained({name}=...) is not supported by lowmem_hf: {_NOT_IMPLEMENTED[name]}.")
        if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
            raise ValueError(f"torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree; pass one of them.")
        requested = dtype if dtype is not None else torch_dtype
        if requested is None:
            requested = "auto"  # transformers 5's default
        if requested != "auto" and not isinstance(requested, dict):
            requested = parse_dtype(requested, argument="torch_dtype" if torch_dtype is not None else "dtype")
        elif isinstance(requested, dict):
            raise NotImplementedError("a per-sub-config dtype dict is not supported; use dtype_overrides.")
        if fetch not in FETCH_MODES:
            raise ValueError(f"fetch={fetch!r} is not a fetch mode; use 'files' (into the HF cache) or 'ranges' (into memory).")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive int, got {chunk_bytes!r}.")
        target_device = _single_device(device, device_map)
        hub_kwargs = {
            "cache_dir": cache_dir,
            "force_download": force_download,
            "local_files_only": local_files_only,
            "proxies": proxies,
            "revision": revision,
            "subfolder": subfolder,
            "token": token,
        }
        return cls._load(
            str(pretrained_model_name_or_path),
            model_args,
            requested_dtype=requested,
            dtype_policy=dtype_policy,
            dtype_overrides=dtype_overrides,
            device=target_device,
            config=config,
            hub_kwargs=hub_kwargs,
            variant=variant,
            use_safetensors=use_safetensors,
            weights_only=weights_only,
            trust_remote_code=trust_remote_code,
            code_revision=code_revision,
            attn_implementation=attn_implementation,
            experts_implementation=experts_implementation,
            ignore_mismatched_sizes=ignore_mismatched_sizes,
            key_mapping=key_mapping,
            generation_config=generation_config,
            output_loading_info=output_loading_info,
            chunk_bytes=chunk_bytes,
            tp=dict(tp_plan=tp_plan, tp_size=tp_size, tp_rank=tp_rank, device_mesh=device_mesh),
            fetch=fetch,
            overrides=config_overrides,
        )

    @classmethod
    def _resolve_class_and_config(cls, path, config, overrides, *, hub_kwargs, trust_remote_code, code_revision):
        """transformers' AutoModel routing: load the config (applying overrides), pick the model class."""
        auto_class = cls._auto_class
        if not isinstance(config, PreTrainedConfig):
            config, model_kwargs = AutoConfig.from_pretrained(
                config if config is not None else path,
                return_unused_kwargs=True,
                trust_remote_code=trust_remote_code,
                code_revision=code_revision,
                **hub_kwargs,
                **overrides,
            )
        else:
            config = copy.deepcopy(config)
            model_kwargs = dict(overrides)

        has_remote_code = hasattr(config, "auto_map") and auto_class.__name__ in config.auto_map
        has_local_code = type(config) in auto_class._model_mapping
        if has_remote_code:
            class_ref = config.auto_map[auto_class.__name__]
            upstream = class_ref.split("--")[0] if "--" in class_ref else None
            trust_remote_code = resolve_trust_remote_code(
                trust_remote_code, path, has_local_code, has_remote_code, upstream_repo=upstream
            )
        if has_remote_code and trust_remote_code:
            model_class = get_class_from_dynamic_module(class_ref, path, code_revision=code_revision, **hub_kwargs)
        elif has_local_code:
            model_class = _get_model_class(config, auto_class._model_mapping)
            text_config_class = config.sub_configs.get("text_config", None)
            if text_config_class is not None and getattr(model_class, "config_class", None) == text_config_class:
                config = config.get_text_config()
        else:
            raise ValueError(
                f"{type(config).__name__} (model_type={config.model_type!r}) has no model for {cls.__name__}. "
                f"Its model types are: {', '.join(sorted(c.model_type for c in auto_class._model_mapping.keys() if hasattr(c, 'model_type')))}."
            )
        return model_class, config, model_kwargs

    @classmethod
    def _load(
        cls,
        path: str,
        model_args: tuple,
        *,
        requested_dtype,
        dtype_policy,
        dtype_overrides,
        device,
        config,
        hub_kwargs,
        variant,
        use_safetensors,
        weights_only,
        trust_remote_code,
        code_revision,
        attn_implementation,
        experts_implementation,
        ignore_mismatched_sizes,
        key_mapping,
        generation_config,
        output_loading_info,
        chunk_bytes,
        tp,
        fetch,
        overrides,
    ):
        started = time.perf_counter()
        # TP first: under torchrun this creates the process group, which the revision pinning below uses so
        # that every rank loads rank 0's commit (transformers' mesh set-up does not depend on the model class).
        tp_request = request_tp(PreTrainedModel, **tp)
        is_hub = _is_hub_repo(path, hub_kwargs["subfolder"])
        if is_hub:
            # one commit for config, index, headers and weights (rank 0 resolves, the others use its sha)
            hub_kwargs = {**hub_kwargs, "revision": pin_revision(path, hub_kwargs["revision"], hub_kwargs)}
        model_class, config, model_kwargs = cls._resolve_class_and_config(
            path, config, overrides, hub_kwargs=hub_kwargs, trust_remote_code=trust_remote_code, code_revision=code_revision
        )
        _reject_unknown({k: v for k, v in model_kwargs.items() if k not in _init_params(model_class)}, model_class=model_class, config=config)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        if experts_implementation is not None:
            config._experts_implementation = experts_implementation

        # 1. resolve: which files, which tensors, where (headers only)
        selection = dict(
            variant=variant,
            use_safetensors=use_safetensors,
            explicit_filename=getattr(config, "transformers_weights", None),
            weights_only=weights_only,
        )
        if is_hub:
            checkpoint = resolve_hub(path, commit=hub_kwargs["revision"], hub=hub_kwargs, **selection)
        else:
            checkpoint = resolve_local(path, subfolder=hub_kwargs["subfolder"], **selection)
        sharded_metadata = dict(checkpoint.index_metadata) if checkpoint.index_metadata is not None else None
        local_files = [checkpoint.local_paths.get(f, f) for f in checkpoint.files]
        if all(os.path.isfile(f) for f in local_files):
            config, main_dtype = _get_dtype(requested_dtype, local_files, config, sharded_metadata, None, weights_only)
        else:
            # transformers infers "auto" from the first file's tensors; the remote headers already say what they are
            first = [i for i in checkpoint.tensors.values() if i.file == checkpoint.files[0]]
            meta_state = {i.key: torch.empty(0, dtype=i.dtype, device="meta") for i in first}
            config, main_dtype = _get_dtype(requested_dtype, None, config, sharded_metadata, meta_state, weights_only)
        config.name_or_path = path

        # 2. build on meta
        model = build_on_meta(model_class, config, main_dtype, model_args, model_kwargs)

        # 3. plan (validated before any tensor byte is read); with TP, shard the skeleton with transformers' engine
        shards = {}
        if tp_request is not None:
            shards, _ = plan_shards(model, tp_request)
            if tp_request.distributed:
                model = distribute(model_class, model, tp_request, shards)
        policy = DtypePolicy.for_model(model, mode=dtype_policy, dtype=main_dtype, overrides=dtype_overrides)
        mapping = map_checkpoint_keys(model, checkpoint.tensors, key_mapping=key_mapping)
        plan = make_plan(model, checkpoint, mapping, policy, ignore_mismatched_sizes=ignore_mismatched_sizes, shards=shards)

        # 4. fetch: Hub files into the HF cache, or byte ranges straight into memory
        paths, source = checkpoint.local_paths, None
        if checkpoint.remote and fetch == "ranges" and checkpoint.format == CheckpointFormat.SAFETENSORS:
            source = HttpRanges(checkpoint.remote, token=hub_kwargs["token"], local=checkpoint.local_paths)
        elif checkpoint.repo_id is not None:
            paths = fetch_files(checkpoint, plan.files, hub_kwargs)

        # 5. stream submodule by submodule, assigning each before reading the next
        loading_info = LoadStateDictInfo(
            missing_keys=set(model.state_dict()),
            unexpected_keys=set(plan.unexpected_keys),
            mismatched_keys=set(plan.mismatched_keys),
            error_msgs=[],
            conversion_errors={},
            skipped_pp_keys=set(),
        )
        stats = StreamStats()
        peak_anon = _proc_status_bytes("RssAnon")
        for _, tensors, staged in stream(
            plan, checkpoint_format=checkpoint.format, device=device, chunk_bytes=chunk_bytes,
            weights_only=weights_only, stats=stats, paths=paths, source=source,
        ):
            _assign.assign_submodule(model, tensors, staged, loading_info)
            peak_anon = max(peak_anon, _proc_status_bytes("RssAnon"))

        # 6. finish as transformers does, then prove it
        _assign.finalize(
            model, plan, loading_info, device=device, name_or_path=path,
            ignore_mismatched_sizes=ignore_mismatched_sizes, device_mesh=getattr(model, "_device_mesh", None),
        )
        _assign.apply_missing_overrides(model, policy, loading_info.missing_keys)
        model.eval()
        model.set_use_kernels(False, None)
        if model.can_generate() and hasattr(model, "adjust_generation_fn"):
            model.adjust_generation_fn(
                generation_config, True, None, path, trust_remote_code=trust_remote_code, **hub_kwargs
            )
        decisions = decisions_of(plan)
        _assign.check_loaded(model, decisions, device)

        if not output_loading_info:
            return model
        notes = list(stats.notes) + [f"{src} duplicates {dst}; transformers keeps the first, so it was not read" for src, dst in mapping.duplicates]
        if tp_request is not None and not tp_request.distributed:
            notes.append(
                f"Loaded only rank {tp_request.tp_rank} of {tp_request.tp_size}'s slices as plain tensors (no process "
                "group): the model's forward is NOT tensor-parallel and will fail or be wrong until a TP engine "
                "wraps these shards; LoadReport.shards says how each parameter is sliced."
            )
        report = LoadReport(
            missing_keys=frozenset(loading_info.missing_keys),
            unexpected_keys=frozenset(loading_info.unexpected_keys),
            mismatched_keys=frozenset(loading_info.mismatched_keys),
            error_msgs=tuple(loading_info.error_msgs),
            checkpoint_format=checkpoint.format,
            files_read=tuple(stats.files_read),
            bytes_read=stats.bytes_read + checkpoint.header_bytes,
            header_bytes=checkpoint.header_bytes,
            dtype=main_dtype,
            dtype_policy=dtype_policy,
            dtype_decisions=decisions,
            model_bytes=_assign.model_nbytes(model),
            staging_bytes=stats.staging_bytes,
            wall_seconds=time.perf_counter() - started,
            peak_rss_anon_bytes=max(peak_anon, _proc_status_bytes("RssAnon")),
            peak_vm_hwm_bytes=_proc_status_bytes("VmHWM"),
            notes=tuple(notes),
            shards=dict(plan.shards),
            commit=checkpoint.commit,
        )
        return model, report


def _make_auto_classes() -> dict[str, type]:
    """One ``LowMem<AutoClass>`` per transformers ``AutoModel*`` class, derived from transformers' auto module."""
    classes = {}
    for name, obj in vars(modeling_auto).items():
        if isinstance(obj, type) and issubclass(obj, _BaseAutoModelClass) and name.startswith("AutoModel"):
            doc = (
                f"Drop-in for ``transformers.{name}``: ``from_pretrained`` streams the checkpoint into a meta-built "
                f"model at ~1.0x memory. See ``LowMemAutoModelBase.from_pretrained``."
            )
            classes[f"LowMem{name}"] = type(f"LowMem{name}", (LowMemAutoModelBase,), {"_auto_class": obj, "__doc__": doc, "__module__": __name__})
    return classes


AUTO_CLASSES: dict[str, type] = _make_auto_classes()
globals().update(AUTO_CLASSES)
__all__ += sorted(AUTO_CLASSES)
