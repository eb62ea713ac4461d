"""The request: every ``from_pretrained`` argument, validated once into one frozen ``LoadRequest``.

All front ends fill the same request: the ``LowMemAutoModel*`` classes, the one-line switch that routes
transformers' own ``from_pretrained`` calls here, and the CLI. ``make_request`` holds the one signature and
the argument checks; nothing downstream re-reads raw keyword arguments. What each argument means, and where it lands
in the ``LoadRequest``, is ``arguments.ARGUMENTS`` (a test keeps the signature and the fields equal to it).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

import torch

from .arguments import DOCS_PAGE, NOT_IMPLEMENTED, arguments_page, transformers_defaults
from .device import load_device
from .distributed.mesh import check_distributed_config
from .errors import ArgumentTypeError, CheckpointNotFoundError, UnsupportedArgumentError, short_repr
from .fetch import FETCH_MODES
from .settings import DEFAULT_SPAN_BYTES
from .plan.dtypes import check_dtype_policy, parse_overrides, requested_dtype
from .stream import DEFAULT_READ_AHEAD_BYTES

__all__ = ["LoadRequest", "HubOptions", "TPOptions", "make_request"]


@dataclass(frozen=True)
class HubOptions:
    """Where and how files come from the Hub (transformers' and huggingface_hub's names)."""

    revision: str | None = None
    """Branch, tag or commit; after ``prepare`` the pinned commit sha."""
    cache_dir: str | None = None
    local_files_only: bool = False
    token: str | bool | None = None
    force_download: bool = False
    proxies: Mapping[str, str] | None = None
    subfolder: str = ""
    """A folder inside the repo (or local folder) that holds config and weights."""

    def as_kwargs(self) -> dict[str, Any]:
        """The keyword arguments transformers' config and remote-code loaders take."""
        return {
            "cache_dir": self.cache_dir,
            "force_download": self.force_download,
            "local_files_only": self.local_files_only,
            "proxies": self.proxies,
            "revision": self.revision,
            "subfolder": self.subfolder,
            "token": self.token,
        }


@dataclass(frozen=True)
class TPOptions:
    """Tensor-parallel arguments as given (validated against the process group in ``distributed.tp.request_tp``)."""

    tp_plan: str | Mapping[str, str] | None = None
    tp_size: int | None = None
    tp_rank: int | None = None
    device_mesh: Any = None
    distributed_config: Any = None
    """transformers' ``DistributedConfig`` (TP, FSDP2, HSDP replicas); see ``lowmem_hf.distributed.mesh``."""

    @property
    def requested(self) -> bool:
        return any(v is not None for v in (self.tp_plan, self.tp_size, self.tp_rank, self.device_mesh, self.distributed_config))


@dataclass(frozen=True)
class LoadRequest:
    """One load, fully specified and validated. Build with ``make_request``; never mutated (use ``dataclasses.replace``)."""

    target: type
    """A transformers ``AutoModel*`` class (routes on the config) or a concrete ``PreTrainedModel`` subclass."""
    name_or_path: str
    """A local folder or a Hub repo id."""
    model_args: tuple = ()
    """Positional arguments for the model's ``__init__``."""
    dtype: torch.dtype | str = "auto"
    """The declared dtype, or ``"auto"`` (config, else checkpoint), decided as transformers 5 does."""
    dtype_policy: str = "declared"
    """``"declared"`` or ``"loaded"`` (see ``plan.dtypes``)."""
    dtype_overrides: tuple[tuple[str, torch.dtype], ...] = ()
    """Ordered ``(glob, dtype)`` rules that beat the policy."""
    device: torch.device = torch.device("cpu")
    config: Any = None
    """A config object or a path to one, instead of the checkpoint's ``config.json``."""
    hub: HubOptions = field(default_factory=HubOptions)
    variant: str | None = None
    use_safetensors: bool | None = None
    weights_only: bool = True
    trust_remote_code: bool | None = None
    code_revision: str | None = None
    attn_implementation: str | Mapping | None = None
    experts_implementation: str | None = None
    ignore_mismatched_sizes: bool = False
    key_mapping: Mapping[str, str] | None = None
    generation_config: Any = None
    output_loading_info: bool = False
    chunk_bytes: int | None = None
    """Chunk size of each read and conversion (staging per worker where staging is needed); None: the load
    chooses by where the bytes come from (``PreparedLoad.stream_chunk_bytes``)."""
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES
    """Reads in flight beyond the submodule being assigned (0: one submodule at a time)."""
    mmap: bool = False
    """Leave same-dtype CPU tensors with a contiguous slice as copy-on-write views of local safetensors files."""
    fetch: str = "files"
    """Hub loads: ``"files"`` (into the HF cache) or ``"ranges"`` (byte ranges into memory)."""
    fetch_span_bytes: int = DEFAULT_SPAN_BYTES
    """``fetch="ranges"`` under a process group: the largest span one request fetches for all ranks."""
    verify_downloads: bool = True
    """Hub loads: hash each LFS file downloaded during the load against the sha256 the Hub publishes (its ETag)."""
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    """Object-store loads: the fsspec filesystem's options (endpoint, credentials: never in a repr); None: the
    provider chain."""
    tp: TPOptions = field(default_factory=TPOptions)
    config_overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Config attributes to override, or model ``__init__`` keywords, routed as transformers routes them."""
    tqdm_class: Any = None
    """A tqdm-compatible class for the progress bar (transformers' argument); ``None`` for tqdm's."""
    checkpoint_format: str | None = None
    """``"dcp"``: a sharded training checkpoint (torch.distributed.checkpoint); ``None``: detected from the files."""

    def with_revision(self, commit: str) -> "LoadRequest":
        """The same request pinned to one commit."""
        return replace(self, hub=replace(self.hub, revision=commit))


def _check_config(config: Any) -> None:
    from transformers import PreTrainedConfig

    if config is not None and not isinstance(config, (str, os.PathLike, PreTrainedConfig)):
        raise TypeError(
            f"config must be a transformers config (PreTrainedConfig), a path to a folder or a config.json, or None "
            f"(the checkpoint's own config.json), got {type(config).__name__} {short_repr(config)}."
        )
    if isinstance(config, (str, os.PathLike)) and not os.path.exists(config):
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(os.fspath(config))
        except HFValidationError:
            raise CheckpointNotFoundError(
                f"config={short_repr(os.fspath(config))} is neither a local folder or file nor a Hub repo id ('org/name'). "
                "Check the path, or pass a transformers config object.",
                key="config", file=os.fspath(config),
            ) from None


def _check_path_argument(argument: str, value: Any, *, expected: str, fix: str) -> None:
    """A path argument (``subfolder``, ``cache_dir``) must be a ``str`` or ``os.PathLike``: anything else would
    reach ``os.path.join`` deep in the load as its ``TypeError``, naming no argument."""
    if not isinstance(value, (str, os.PathLike)):
        found = f"{type(value).__name__} {short_repr(value)}"
        raise ArgumentTypeError(f"{argument} must be {expected}, got {found}. {fix}", key=argument, expected=expected, found=found, fix=fix)


def _check_generation_config(generation_config: Any) -> None:
    """transformers copies it with ``generation_config.to_dict()`` after the weights are loaded: anything else would be
    an ``AttributeError`` from its generation utils at the very end of the load."""
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(
            "generation_config must be a transformers GenerationConfig, or None for the checkpoint's own "
            f"generation_config.json, got {type(generation_config).__name__} {short_repr(generation_config)}. To load one "
            "from a folder: GenerationConfig.from_pretrained(path)."
        )


def _check_key_mapping(key_mapping: Any) -> None:
    """transformers' ``key_mapping``: ``{regex: replacement}``, applied with ``re.sub`` to every checkpoint key."""
    if key_mapping is None:
        return
    if not isinstance(key_mapping, Mapping):
        raise TypeError(f"key_mapping must be a dict of {{regex: replacement}}, got {type(key_mapping).__name__} {short_repr(key_mapping)}.")
    for pattern, replacement in key_mapping.items():
        if not isinstance(pattern, str) or not isinstance(replacement, str):
            raise TypeError(
                f"key_mapping entries must be str regex -> str replacement, got {short_repr(pattern)}: {short_repr(replacement)}."
            )
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"key_mapping[{pattern!r}] is not a regular expression: {e}. Keys are regexes applied with re.sub; "
                "escape literal characters (re.escape)."
            ) from None


def make_request(
    target: type,
    pretrained_model_name_or_path: str | os.PathLike,
    *model_args: Any,
    torch_dtype: Any = None,
    dtype: Any = None,
    dtype_policy: str = "declared",
    dtype_overrides: Any = None,
    device: str | torch.device | None = None,
    device_map: Any = None,
    config: Any = None,
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
    chunk_bytes: int | None = None,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
    mmap: bool = False,
    fetch: str = "files",
    fetch_span_bytes: int = DEFAULT_SPAN_BYTES,
    verify_downloads: bool = True,
    storage_options: dict | None = None,
    tp_plan: str | dict | None = None,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    device_mesh: Any = None,
    distributed_config: Any = None,
    tqdm_class: Any = None,
    checkpoint_format: str | None = None,
    **config_overrides: Any,
) -> LoadRequest:
    """Validate ``from_pretrained``'s arguments into a ``LoadRequest`` (see ``LowMemAutoModelBase.from_pretrained``).

    ``low_cpu_mem_usage`` and ``disable_mmap`` are accepted for compatibility and have no effect: lowmem_hf
    always streams (transformers 5 ignores ``low_cpu_mem_usage`` too).

    Raises:
        UnsupportedArgumentError: a transformers argument lowmem_hf does not implement (names it), or the meta
            device (``device``/``device_map``), which would give a model with no weights.
        ValueError: a bad dtype (one transformers does not load floats into), dtype policy, fetch mode, chunk size,
            device or device combination, or a ``key_mapping`` key that is not a regex.
        TypeError: a ``config`` that is neither a config, a path nor None; a ``key_mapping`` that is not a str dict;
            a ``subfolder`` or ``cache_dir`` that is not a path (``ArgumentTypeError``, naming it).
    """
    for name in sorted(n for n in config_overrides if n in NOT_IMPLEMENTED):
        value = config_overrides.pop(name)
        if not transformers_defaults().is_default(name, value):
            raise UnsupportedArgumentError(
                name, f"from_pretrained({name}={short_repr(value)}) is not supported by lowmem_hf: {NOT_IMPLEMENTED[name]}."
            )
    distributed_config = check_distributed_config(distributed_config)
    requested = requested_dtype(torch_dtype, dtype)
    check_dtype_policy(dtype_policy)
    if variant is not None and (not isinstance(variant, str) or not variant):
        # transformers inserts it as it is: variant='' looks for model..safetensors and finds nothing
        raise ValueError(
            f"variant={short_repr(variant)} names no variant: expected a non-empty str such as 'fp16' (for "
            "model.fp16.safetensors), or None for the plain weight files."
        )
    _check_config(config)
    _check_path_argument(
        "subfolder", subfolder, expected="a str path inside the checkpoint ('' for its top folder)",
        fix="Pass subfolder='' (the default) for the top folder.",
    )
    if cache_dir is not None:
        _check_path_argument(
            "cache_dir", cache_dir, expected="a str path to the HF cache folder, or None",
            fix="Pass a folder path, or leave it out for the default HF cache.",
        )
    _check_generation_config(generation_config)
    _check_key_mapping(key_mapping)
    _check_read_options(
        fetch=fetch, chunk_bytes=chunk_bytes, read_ahead_bytes=read_ahead_bytes, mmap=mmap, disable_mmap=disable_mmap,
        fetch_span_bytes=fetch_span_bytes, verify_downloads=verify_downloads, checkpoint_format=checkpoint_format,
        storage_options=storage_options,
    )
    return LoadRequest(
        target=target,
        name_or_path=os.fspath(pretrained_model_name_or_path),
        model_args=tuple(model_args),
        dtype=requested,
        dtype_policy=dtype_policy,
        dtype_overrides=parse_overrides(dtype_overrides),
        device=load_device(device, device_map),
        config=config,
        hub=HubOptions(
            revision=revision,
            cache_dir=os.fspath(cache_dir) if cache_dir is not None else None,
            local_files_only=local_files_only,
            token=token,
            force_download=force_download,
            proxies=proxies,
            subfolder=subfolder,
        ),
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
        read_ahead_bytes=read_ahead_bytes,
        mmap=mmap,
        fetch=fetch,
        fetch_span_bytes=fetch_span_bytes,
        verify_downloads=verify_downloads,
        storage_options=MappingProxyType(dict(storage_options)) if storage_options is not None else None,
        tp=TPOptions(tp_plan=tp_plan, tp_size=tp_size, tp_rank=tp_rank, device_mesh=device_mesh, distributed_config=distributed_config),
        config_overrides=MappingProxyType(dict(config_overrides)),
        tqdm_class=tqdm_class,
        checkpoint_format=checkpoint_format,
    )

def _check_read_options(
    *, fetch: str, chunk_bytes: Any, read_ahead_bytes: Any, mmap: Any, disable_mmap: Any, fetch_span_bytes: Any,
    verify_downloads: Any, checkpoint_format: Any, storage_options: Any,
) -> None:
    """The arguments that steer how the bytes are read: each its type and range, or a ``ValueError`` naming it."""
    if fetch not in FETCH_MODES:
        raise ValueError(f"fetch={fetch!r} is not a fetch mode; use 'files' (into the HF cache) or 'ranges' (into memory).")
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1):
        raise ValueError(f"chunk_bytes must be a positive int (or None: the load chooses), got {chunk_bytes!r}.")
    if not isinstance(read_ahead_bytes, int) or isinstance(read_ahead_bytes, bool) or read_ahead_bytes < 0:
        raise ValueError(f"read_ahead_bytes must be an int >= 0 (0 reads one submodule at a time), got {read_ahead_bytes!r}.")
    if not isinstance(mmap, bool):
        raise ValueError(f"mmap must be True or False, got {mmap!r}.")
    if mmap and disable_mmap:
        raise ValueError("mmap=True and disable_mmap=True disagree; pass one of them.")
    if not isinstance(fetch_span_bytes, int) or isinstance(fetch_span_bytes, bool) or fetch_span_bytes < 1:
        raise ValueError(f"fetch_span_bytes must be a positive int, got {fetch_span_bytes!r}.")
    if not isinstance(verify_downloads, bool):
        raise ValueError(f"verify_downloads must be True or False, got {verify_downloads!r}.")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        found = type(storage_options).__name__
        fix = "Pass a dict such as {'endpoint_url': ...}, or None for the provider chain."
        raise ArgumentTypeError(
            f"storage_options must be a dict of the fsspec filesystem's options, got {found}. {fix}",
            key="storage_options", expected="a dict or None", found=found, fix=fix,
        )
    if checkpoint_format not in (None, "dcp"):
        raise ValueError(
            f"checkpoint_format={checkpoint_format!r} is not a checkpoint format; use 'dcp' for a sharded training "
            "checkpoint (torch.distributed.checkpoint), or leave it None to detect the format from the files."
        )


def signature_defaults() -> dict[str, Any]:
    """``make_request``'s defaults by argument name, as ``docs/arguments.md`` shows them."""
    return {
        name: p.default for name, p in inspect.signature(make_request).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m lowmem_hf.request --write-docs`` writes ``docs/arguments.md`` from ``arguments.ARGUMENTS`` and
    this signature's defaults; ``--check`` exits 1 where the page is stale."""
    parser = argparse.ArgumentParser(prog="python -m lowmem_hf.request", description=main.__doc__)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-docs", action="store_true", help=f"write {DOCS_PAGE}")
    action.add_argument("--check", action="store_true", help=f"exit 1 if {DOCS_PAGE} is not what --write-docs writes")
    args = parser.parse_args(argv)
    page = arguments_page(signature_defaults())
    if args.check:
        stale = not DOCS_PAGE.exists() or DOCS_PAGE.read_text() != page
        print(f"{DOCS_PAGE} is {'stale: run python -m lowmem_hf.request --write-docs' if stale else 'current'}")
        return int(stale)
    DOCS_PAGE.parent.mkdir(parents=True, exist_ok=True)
    DOCS_PAGE.write_text(page)
    print(f"wrote {DOCS_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
