"""The one list of ``from_pretrained`` arguments: name, where it lands in the ``LoadRequest``, and its doc.

``make_request`` (``request.py``) spells the signature out, since a reader and an IDE need it in the code; the
``LowMemAutoModel*.from_pretrained`` docstring and ``docs/arguments.md`` are written from ``ARGUMENTS``;
``tests/test_arguments.py`` checks that the signature, ``LoadRequest``'s fields, the docstring and the page all
agree with it, so an argument is added in one place and a test names the others. Regenerate the page with
``python -m lowmem_hf.request --write-docs`` (the defaults come from the signature).

Also what is known of transformers' own arguments: those lowmem_hf refuses (``NOT_IMPLEMENTED``) and the defaults
transformers reads from its own code (``transformers_defaults``). Nothing here imports torch: ``import lowmem_hf``
stays cheap, and the page is written without a model stack.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

__all__ = [
    "Argument",
    "ARGUMENTS",
    "SECTIONS",
    "NOT_IMPLEMENTED",
    "TransformersDefaults",
    "transformers_defaults",
    "from_pretrained_doc",
    "arguments_page",
    "DOCS_PAGE",
]


@dataclass(frozen=True)
class Argument:
    """One keyword (or the positional or ``**`` rest) of ``make_request`` and ``from_pretrained``."""

    name: str
    """As in the signature, with ``*``/``**`` for the positional and keyword rest."""
    field: str | None
    """Where its value lands in ``LoadRequest`` (``"hub.revision"``); None: accepted for compatibility, no effect."""
    section: str
    """The heading it is listed under in ``docs/arguments.md`` (a key of ``SECTIONS``)."""
    doc: str
    """What it does, for the docstring and the page."""


# Headings of docs/arguments.md, in page order.
SECTIONS = {
    "what": "What to load",
    "dtype": "Dtypes",
    "device": "Device",
    "hub": "Hub",
    "model": "The model transformers builds",
    "reading": "How the bytes are read",
    "distributed": "Tensor parallelism and meshes",
}

# In make_request's signature order (the test checks it).
ARGUMENTS: tuple[Argument, ...] = (
    Argument("pretrained_model_name_or_path", "name_or_path", "what",
             "a local folder saved with ``save_pretrained``, or a Hub repo id."),
    Argument("*model_args", "model_args", "what", "passed to the model's ``__init__``, as in transformers."),
    Argument("torch_dtype", "dtype", "dtype",
             "the declared dtype: a ``torch.dtype``, its name, or ``\"auto\"``/``None`` for the config's dtype (else the "
             "checkpoint's), exactly as transformers 5 decides it."),
    Argument("dtype", "dtype", "dtype", "transformers 5's name for ``torch_dtype``; pass one of the two."),
    Argument("dtype_policy", "dtype_policy", "dtype",
             "``\"declared\"`` (every tensor gets the declared dtype, unless the model keeps it in fp32 or builds it in "
             "another dtype, as in transformers) or ``\"loaded\"`` (every tensor keeps its checkpoint dtype). See "
             "``lowmem_hf.plan.dtypes``."),
    Argument("dtype_overrides", "dtype_overrides", "dtype",
             "ordered ``{glob: dtype}`` (or list of pairs) that beats the policy, first match wins, e.g. "
             "``{\"*.norm.weight\": torch.float32}``."),
    Argument("device", "device", "device",
             "where the parameters go. Default: as transformers decides with no ``device_map``, the ambient device (a "
             "``with torch.device(...)`` block or ``torch.set_default_device``), else ``\"cpu\"``; under ``meta`` "
             "transformers' ``RuntimeError``."),
    Argument("device_map", "device", "device", "transformers' spelling of ``device``; only a single device is supported."),
    Argument("config", "config", "what", "a config object or a path to one, instead of the folder's ``config.json``."),
    Argument("revision", "hub.revision", "hub",
             "branch, tag or commit of a Hub repo; the load pins it to one commit for every file (and every rank)."),
    Argument("cache_dir", "hub.cache_dir", "hub", "the HF cache folder, as in transformers."),
    Argument("local_files_only", "hub.local_files_only", "hub", "use the HF cache only, never the network, as in transformers."),
    Argument("token", "hub.token", "hub", "the Hub token, as in transformers."),
    Argument("force_download", "hub.force_download", "hub", "download again what the HF cache holds, as in transformers."),
    Argument("proxies", "hub.proxies", "hub", "proxies for the Hub's requests, as in transformers."),
    Argument("subfolder", "hub.subfolder", "what",
             "a folder inside the repo (or local folder) that holds config and weights, as in transformers."),
    Argument("variant", "variant", "what",
             "which weight files, as in transformers: ``\"fp16\"`` reads ``model.fp16.safetensors``."),
    Argument("use_safetensors", "use_safetensors", "what", "prefer (``True``) or refuse (``False``) safetensors files, as in transformers."),
    Argument("weights_only", "weights_only", "what",
             "restrict ``.bin`` unpickling to tensors (default). Pass ``False`` only for files you trust."),
    Argument("trust_remote_code", "trust_remote_code", "model", "allow the config's ``auto_map`` model code, as in transformers."),
    Argument("code_revision", "code_revision", "hub", "the revision of remote model code, as in transformers."),
    Argument("attn_implementation", "attn_implementation", "model", "as in transformers."),
    Argument("experts_implementation", "experts_implementation", "model", "as in transformers."),
    Argument("ignore_mismatched_sizes", "ignore_mismatched_sizes", "model",
             "initialize (instead of failing on) parameters whose stored shape differs."),
    Argument("key_mapping", "key_mapping", "what",
             "``{regex: replacement}`` renames applied to checkpoint keys before transformers' own."),
    Argument("generation_config", "generation_config", "model",
             "a ``GenerationConfig`` to use instead of the folder's ``generation_config.json``."),
    Argument("output_loading_info", "output_loading_info", "model", "also return the ``LoadReport``."),
    Argument("low_cpu_mem_usage", None, "reading",
             "accepted for compatibility; lowmem_hf always streams (transformers 5 ignores it too)."),
    Argument("disable_mmap", None, "reading",
             "accepted for compatibility (lowmem_hf memory-maps nothing unless ``mmap=True``)."),
    Argument("chunk_bytes", "chunk_bytes", "reading",
             "the chunk size of each read and conversion (staging per reader thread where needed). Default: 4 MiB, "
             "lowered from files in the page cache so staging stays within 1/128 of the bytes loaded; from a cold disk "
             "8 MiB, lowered so staging stays within 1/32 (larger reads keep the disk busy)."),
    Argument("read_ahead_bytes", "read_ahead_bytes", "reading",
             "reads of the next submodules in flight while one is assigned (default 64 MiB; 0: none)."),
    Argument("mmap", "mmap", "reading",
             "leave every loaded tensor as a copy-on-write view of its local safetensors file (inference on CPU; the "
             "file must not change while the model lives). Refused (``ValueError``, before any read) where a tensor "
             "cannot be a view: a dtype change, a dim-1 TP slice, a non-CPU device, ``.bin``/DCP, ``fetch='ranges'``, "
             "tensors transformers merges. Default: owned memory."),
    Argument("fetch", "fetch", "hub",
             "for Hub repos: ``\"files\"`` downloads into the HF cache only the shard files this rank's plan touches; "
             "``\"ranges\"`` fetches only the planned byte ranges into memory and writes no shard to disk (safetensors "
             "only; ``.bin`` shards are always fetched whole). Ignored for local folders. Under a process group, "
             "``\"ranges\"`` is the cooperative fetch (``lowmem_hf.sources.exchange``): each byte is fetched once by "
             "one rank, in spans of at most ``fetch_span_bytes`` (default 16 MiB), and the ranks send each other the "
             "pieces over the group."),
    Argument("fetch_span_bytes", "fetch_span_bytes", "hub", "the largest span one request of the cooperative fetch asks for."),
    Argument("verify_downloads", "verify_downloads", "hub",
             "for Hub repos (default ``True``): every file downloaded during the load (the shards of "
             "``fetch=\"files\"``, ``.bin`` shards) is hashed before it is read and compared with the sha256 the Hub "
             "publishes for LFS files (their ETag); a mismatch removes the file from the HF cache and downloads it "
             "once more, then raises ``CorruptDownloadError``. ``False`` skips the hashing (size and ETag are still "
             "compared with the plan). Files already in the cache are not hashed again."),
    Argument("storage_options", "storage_options", "hub",
             "for object-store URLs (``s3://bucket/prefix``, any fsspec URL): passed to the fsspec filesystem, as "
             "pandas, datasets and DCP take it (``{\"endpoint_url\": ..., \"key\": ..., \"secret\": ...}``, "
             "``{\"anon\": True}``, ``{\"profile\": ...}``). Default: the provider chain (environment, "
             "``AWS_PROFILE``, instance role) and ``AWS_ENDPOINT_URL``. See docs/object-storage.md."),
    Argument("tp_plan", "tp.tp_plan", "distributed",
             "tensor parallelism: ``\"auto\"`` (the model's own plan: ``_tp_plan`` merged with "
             "``config.base_model_tp_plan``) or a dict of rules overriding it. Under a process group (or torchrun) the "
             "model is sharded by transformers' TP engine and each rank reads only its slices; see "
             "``lowmem_hf.distributed.tp``."),
    Argument("tp_size", "tp.tp_size", "distributed",
             "defaults to the process group's. Without a group, with ``tp_rank`` given too: load only rank "
             "``tp_rank``'s slices as plain tensors (no TP forward); ``LoadReport.shards`` describes them."),
    Argument("tp_rank", "tp.tp_rank", "distributed", "defaults to the process group's; see ``tp_size``."),
    Argument("device_mesh", "tp.device_mesh", "distributed",
             "a 1-D tp mesh (its size must equal ``tp_size``), or an n-D mesh over every rank whose dims are named from "
             "``(\"dp_replicate\", \"fsdp\", \"tp\")`` in that order; its sizes become (or must agree with) "
             "``distributed_config``'s. Without a group, ``lowmem_hf.distributed.MeshRank(rank, tp_size, fsdp_size, "
             "dp_replicate_size)``: load only the shards that rank of such a mesh holds, as plain tensors (a dry run or "
             "one rank's share of a large job, tested against transformers' own placements)."),
    Argument("distributed_config", "tp.distributed_config", "distributed",
             "transformers' ``DistributedConfig(tp_size, fsdp_size, dp_replicate_size, fsdp_plan, fsdp_cpu_offload, "
             "fsdp_mixed_precision)`` (or a dict of its fields): the model is sharded by transformers' own engine (TP, "
             "then FSDP2 ``fully_shard``), exactly as ``from_pretrained`` with the same config does, and each rank "
             "reads only the bytes its DTensor placements own. ``pp_size``/``ep_size`` above 1 raise "
             "``UnsupportedArgumentError``. See ``lowmem_hf.distributed.mesh``."),
    Argument("tqdm_class", "tqdm_class", "model", "a tqdm-compatible class for the progress bar, as in transformers."),
    Argument("checkpoint_format", "checkpoint_format", "what",
             "``\"dcp\"``: a sharded training checkpoint (``torch.distributed.checkpoint``); ``None``: detected from "
             "the files."),
    Argument("**config_overrides", "config_overrides", "model",
             "config attributes to override (``num_labels=3``), or arguments of the model's ``__init__``, exactly as "
             "transformers routes them."),
)

# transformers' documented from_pretrained arguments whose behaviour lowmem_hf does not implement. Each raises
# UnsupportedArgumentError naming it, rather than being silently dropped; the switch hands such calls to
# transformers' own loader instead.
NOT_IMPLEMENTED = {
    "state_dict": "pass a folder saved with save_pretrained instead",
    "quantization_config": "quantized loading is not supported; load in a float dtype",
    "gguf_file": "GGUF files are not supported; convert to safetensors",
    "max_memory": "lowmem_hf places the whole model on one device",
    "offload_folder": "disk offload is not supported",
    "offload_buffers": "disk offload is not supported",
    "offload_state_dict": "disk offload is not supported",
    "adapter_kwargs": "PEFT adapters are not supported; load the base model, then attach the adapter with peft",
    "adapter_name": "PEFT adapters are not supported; load the base model, then attach the adapter with peft",
    "use_kernels": "hub kernels are not supported",
    "kernel_config": "hub kernels are not supported",
    "allow_all_kernels": "hub kernels are not supported",
    "fusion_config": "fusion patches are not supported",
    "from_tf": "TensorFlow checkpoints are not supported",
    "from_flax": "Flax checkpoints are not supported",
    "mirror": "mirrors are not supported",
}

# Arguments whose value only matters when the path holds a PEFT adapter; lowmem_hf hands every adapter folder
# to transformers (``load._reject_adapter``), so with no adapter any value leaves the load unchanged.
_ONLY_WITH_AN_ADAPTER = frozenset({"adapter_name"})


@dataclass(frozen=True)
class TransformersDefaults:
    """What transformers' ``PreTrainedModel.from_pretrained`` does with its arguments, read from its own code."""

    defaults: Mapping[str, Any]
    """Argument -> the value transformers uses when it is not passed (signature defaults and ``kwargs.pop``)."""
    ignored: frozenset[str]
    """Arguments transformers pops and drops whatever their value (``from_tf``, ``low_cpu_mem_usage``, ...)."""
    falsy_is_default: frozenset[str]
    """Arguments read as ``kwargs.pop(name, d) or d``: any falsy value means the default."""

    def is_default(self, name: str, value: Any) -> bool:
        """Whether passing ``name=value`` leaves transformers' behaviour as if it had not been passed."""
        if name in self.ignored or name in _ONLY_WITH_AN_ADAPTER:
            return True
        if name not in self.defaults:
            return False
        default = self.defaults[name]
        if value is default:
            return True
        if name in self.falsy_is_default and isinstance(value, (dict, list, tuple, type(None))) and not value:
            return True
        # the type check keeps 0 == False and 1 == True from passing for each other
        return type(value) is type(default) and isinstance(value, (bool, int, float, str)) and value == default


@functools.cache
def transformers_defaults() -> TransformersDefaults:
    """Read transformers' defaults from the source of its ``from_pretrained``, so they cannot drift from a
    hand-written list: most arguments are not in its signature but popped from ``**kwargs`` in its body
    (``kwargs.pop("offload_buffers", False)``), and some are popped and dropped in a loop. Nothing in
    transformers exposes these as data, hence the parse."""
    from transformers import PreTrainedModel

    function = PreTrainedModel.__dict__["from_pretrained"].__func__
    if function.__module__ != PreTrainedModel.__module__:
        # the switch reads these before it replaces the method (patch_transformers), so this is a bug, not input
        raise RuntimeError(f"transformers_defaults() read {function.__module__}.{function.__name__}, not transformers' own")
    defaults: dict[str, Any] = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.default is not inspect.Parameter.empty:
            defaults[name] = parameter.default
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    ignored: set[str] = set()
    falsy: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.List, ast.Tuple)):
            names = [e.value for e in node.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if any(_is_kwargs_pop(call) for call in ast.walk(node)):
                ignored.update(names)  # for name in [...]: kwargs.pop(name, None)
        elif _is_kwargs_pop(node) and isinstance(node.args[0], ast.Constant):
            try:
                defaults[node.args[0].value] = ast.literal_eval(node.args[1]) if len(node.args) > 1 else None
            except ValueError:
                pass  # a default that is not a literal: no value can be known to equal it
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            falsy.update(v.args[0].value for v in node.values if _is_kwargs_pop(v) and isinstance(v.args[0], ast.Constant))
    return TransformersDefaults(defaults=MappingProxyType(defaults), ignored=frozenset(ignored), falsy_is_default=frozenset(falsy))


def _is_kwargs_pop(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop"
        and isinstance(node.func.value, ast.Name) and node.func.value.id == "kwargs" and bool(node.args)
    )


_DOC_HEAD = """Load a pretrained model like ``transformers.AutoModel*.from_pretrained``, at ~1.0x its size in memory.

Every argument is keyword-only but the first two; ``docs/arguments.md`` lists them by topic, with their defaults.

Args:
"""

_DOC_TAIL = """
Returns:
    The model in eval mode, or ``(model, LoadReport)`` with ``output_loading_info=True``.

Raises:
    TypeError: an unknown keyword (names the closest valid one).
    UnsupportedArgumentError (a NotImplementedError): a transformers argument lowmem_hf does not
        implement (names it).
    ValueError: a bad dtype, dtype policy or device combination.
    OSError: a missing or corrupt checkpoint (see ``lowmem_hf.errors``).

Example:
    >>> model = LowMemAutoModelForCausalLM.from_pretrained("./my-llama", torch_dtype=torch.bfloat16)
"""


def from_pretrained_doc() -> str:
    """The docstring of ``LowMemAutoModel*.from_pretrained`` (what ``help()`` shows), Google style."""
    args = "".join(
        textwrap.fill(f"{a.name}: {a.doc}", width=112, initial_indent="    ", subsequent_indent="        ") + "\n"
        for a in ARGUMENTS
    )
    return _DOC_HEAD + args + _DOC_TAIL


DOCS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "arguments.md"


def arguments_page(defaults: Mapping[str, Any]) -> str:
    """``docs/arguments.md``: every argument by section, with its default (``defaults``: name -> its default in
    ``make_request``'s signature), then the transformers arguments lowmem_hf refuses."""
    lines = [
        "# `from_pretrained` arguments",
        "",
        "<!-- Written by `python -m lowmem_hf.request --write-docs` from `lowmem_hf/arguments.py`; edit that. -->",
        "",
        "`LowMemAutoModel*.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)` and "
        "`lowmem_hf.make_request` take the same arguments, with transformers' names and defaults where transformers "
        "has the argument. An unknown keyword raises `TypeError` naming the closest valid one.",
    ]
    for key, title in SECTIONS.items():
        lines += ["", f"## {title}", ""]
        for a in (a for a in ARGUMENTS if a.section == key):
            default = f" (default {_default(defaults[a.name])})" if a.name in defaults else ""
            lines.append(f"- **`{a.name}`**{default}: {_markdown(a.doc)}")
    lines += [
        "",
        "## Refused",
        "",
        "transformers arguments whose behaviour lowmem_hf does not implement raise `UnsupportedArgumentError` naming "
        "them, unless the value passed is transformers' default (under the one-line switch, such a call is handed to "
        "transformers' own loader):",
        "",
    ]
    lines += [f"- **`{name}`**: {why}." for name, why in NOT_IMPLEMENTED.items()]
    return "\n".join(lines) + "\n"


def _default(value: Any) -> str:
    shown = f"`{value!r}`"
    mib = 1 << 20
    if type(value) is int and value >= mib and value % mib == 0:
        shown += f", {value // mib} MiB"
    return shown


def _markdown(doc: str) -> str:
    """reStructuredText literals (double backticks, as in docstrings) as Markdown code spans."""
    return doc.replace("``", "`")
