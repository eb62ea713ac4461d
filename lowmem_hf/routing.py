"""transformers' routing, as its ``from_pretrained`` does it: which checkpoint (a local folder, a training checkpoint
or a Hub repo), which config (loaded, overrides applied) and which model class; and what a request that lowmem_hf
must not load looks like (unknown keywords, a quantized checkpoint, a PEFT adapter).

transformers' config code lets a ``KeyError``, a ``ZeroDivisionError`` or a dataclass validation error out as it
is, naming neither the file nor the field; the diagnostics here (``config_error_message``) name both, so every
stage that runs transformers' config or model code on a config (loading it here, building on meta in
``build.py``) reports a bad value the same way.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import os
import re
import traceback
from dataclasses import replace
from typing import Any, Callable

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoConfig, PreTrainedConfig
from transformers.dynamic_module_utils import get_class_from_dynamic_module, resolve_trust_remote_code
from transformers.utils import CONFIG_NAME

from .compat import transformers_api as hf
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedArgumentError, short_repr
from .formats import dcp
from .hub import resolve_hub
from .request import NOT_IMPLEMENTED, LoadRequest, make_request
from .resolve import resolve_dcp, resolve_local
from .resolve_store import PinnedStore, pin_store, resolve_store
from .types import Checkpoint, CheckpointFormat

__all__ = [
    "is_hub_repo", "reject_adapter", "resolve_class_and_config", "reject_quantized", "init_params", "reject_unknown",
    "resolve_checkpoint", "pin_stored", "resolve_stored", "config_source", "config_error_message", "generation_config_source",
]


def is_hub_repo(path: str, subfolder: str) -> bool:
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


def reject_adapter(request: LoadRequest) -> None:
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


def resolve_class_and_config(request: LoadRequest) -> tuple[type, Any, dict[str, Any]]:
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
                f"{config_source(request) or CONFIG_NAME} is not a valid JSON file: {type(cause).__name__}: {cause}. "
                "Fix the file (it must be UTF-8 JSON holding one object), or pass a valid config=."
            ) from e
        missing = _missing_config(request.config, e)
        if missing is not None:
            raise missing from e
        raise
    except ImportError:
        raise
    except Exception as e:
        source = config_source(request)
        if source is None:
            # a local folder with no config.json: transformers' "Unrecognized model in ..." (kept, it is what callers
            # match), plus where it looked: its message names neither the subfolder nor the file
            where = os.path.join(os.fspath(request.config) if request.config is not None else request.name_or_path, request.hub.subfolder)
            raise ValueError(
                f"{' '.join(str(e).split())} There is no {CONFIG_NAME} in {os.path.abspath(where)}"
                + (f" (subfolder={request.hub.subfolder!r})" if request.hub.subfolder else "")
                + ": pass the folder save_pretrained wrote, or config=."
            ) from e
        raise ValueError(config_error_message(e, source, request)) from e


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


def reject_quantized(config: Any) -> None:
    """A quantized checkpoint needs transformers' quantizers, which lowmem_hf does not implement."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method", "?")
        raise UnsupportedArgumentError(
            "quantization_config",
            f"the checkpoint's config.json has a quantization_config (quant_method={method!r}); quantized "
            "checkpoints are not supported by lowmem_hf: load them with transformers' from_pretrained.",
        )


def init_params(model_class: type) -> set[str]:
    """Keyword parameters ``model_class.__init__`` names explicitly (where unknown kwargs may legitimately go)."""
    params = inspect.signature(model_class.__init__).parameters
    return {n for n, p in params.items() if n not in ("self", "config") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def reject_unknown(unknown: dict[str, Any], *, model_class: type, config: Any) -> None:
    """A keyword that is no from_pretrained argument, config attribute or ``__init__`` parameter is a typo, not an
    override: a ``TypeError`` naming the closest valid name, as for any Python call."""
    if not unknown:
        return
    valid = set(inspect.signature(make_request).parameters) | set(NOT_IMPLEMENTED)
    properties = {n for n in dir(type(config)) if isinstance(getattr(type(config), n, None), property) and not n.startswith("_")}
    valid |= set(config.to_dict()) | properties | init_params(model_class)
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


def resolve_checkpoint(request: LoadRequest, config: Any, is_hub: bool) -> Checkpoint:
    """The checkpoint's files and tensors, from headers only: a training checkpoint (DCP), a Hub repo at the pinned
    commit, or a local folder; the weight file is chosen as transformers chooses it (variant, use_safetensors,
    ``config.transformers_weights``)."""
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


def pin_stored(request: LoadRequest) -> PinnedStore:
    """An object-store checkpoint listed once, its small files mirrored locally (``resolve_store.pin_store``)."""
    return pin_store(
        request.name_or_path, storage_options=request.storage_options, subfolder=request.hub.subfolder,
        need_config=request.config is None,
    )


def resolve_stored(request: LoadRequest, config: Any, store: PinnedStore) -> Checkpoint:
    """``resolve_checkpoint`` for an object store: the weight file chosen as transformers chooses it."""
    return resolve_store(
        store, variant=request.variant, use_safetensors=request.use_safetensors,
        explicit_filename=getattr(config, "transformers_weights", None), weights_only=request.weights_only,
        checkpoint_format=request.checkpoint_format,
    )


def config_source(request: LoadRequest) -> str | None:
    """The config file transformers read: a local file, or a description of the Hub repo's; None if there is none."""
    config, subfolder = request.config, request.hub.subfolder
    source = os.fspath(config) if config is not None else request.name_or_path
    if os.path.isdir(source):
        source = os.path.join(source, subfolder, CONFIG_NAME)
        return source if os.path.isfile(source) else None
    if os.path.isfile(source):
        return source
    return f"{CONFIG_NAME} of the Hub repo {source!r}" + (f" (subfolder {subfolder!r})" if subfolder else "")


def config_error_message(
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


def generation_config_source(request: LoadRequest, checkpoint: Checkpoint) -> str | None:
    """Where transformers' ``adjust_generation_fn`` looks for ``generation_config.json`` (then ``config.json``).

    The checkpoint's folder, as in transformers, except for a training checkpoint that holds neither file
    (``dcp.save`` writes only ``.metadata`` and ``*.distcp``): then the folder of ``config=`` when it is a path, or
    None when it is a config object, whose model already built its generation config from the config at
    ``__init__``, exactly as transformers builds one when no file has it. An object store's files are read in its
    local mirror (``checkpoint.config_dir``).
    """
    if checkpoint.config_dir is not None:
        request = replace(request, name_or_path=checkpoint.config_dir)
    if request.generation_config is not None or checkpoint.format != CheckpointFormat.DCP:
        return request.name_or_path
    folder = os.path.join(request.name_or_path, request.hub.subfolder)
    if any(os.path.isfile(os.path.join(folder, name)) for name in ("generation_config.json", "config.json")):
        return request.name_or_path
    if isinstance(request.config, (str, os.PathLike)):
        config_path = os.fspath(request.config)
        return os.path.dirname(config_path) if os.path.isfile(config_path) else config_path
    return None
