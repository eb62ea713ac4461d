"""``LowMemAutoModel*``: drop-in ``AutoModel*.from_pretrained`` that streams weights into a meta-built model.

``from_pretrained`` validates its arguments into one ``LoadRequest`` (``request.py``) and runs the recipe
(``load.py``): ``prepare`` (resolve, build on meta, plan) then ``execute`` (fetch, stream, assign, finalize).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from transformers.models.auto import modeling_auto

from .compat.transformers_api import is_auto_class
from .load import load
from .request import make_request

__all__ = ["LowMemAutoModelBase", "AUTO_CLASSES"]


class LowMemAutoModelBase:
    """Base of every ``LowMemAutoModel*`` class; ``_auto_class`` is the transformers auto class it stands in for."""

    _auto_class: type = None  # type: ignore[assignment]

    def __init__(self, *args, **kwargs):
        raise EnvironmentError(f"{type(self).__name__} is not instantiable; use {type(self).__name__}.from_pretrained(...)")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *model_args: Any, **kwargs: Any):
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
            device: where the parameters go. Default: as transformers decides with no ``device_map``, the ambient
                device (a ``with torch.device(...)`` block or ``torch.set_default_device``), else ``"cpu"``;
                under ``meta`` transformers' ``RuntimeError``.
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
            disable_mmap: accepted for compatibility (lowmem_hf memory-maps nothing unless ``mmap=True``).
            mmap: leave every loaded tensor as a copy-on-write view of its local safetensors file (inference on
                CPU; the file must not change while the model lives). Refused (``ValueError``, before any read)
                where a tensor cannot be a view: a dtype change, a dim-1 TP slice, a non-CPU device, ``.bin``/DCP,
                ``fetch='ranges'``, tensors transformers merges. Default: owned memory.
            chunk_bytes: the chunk size of each read and conversion (staging per reader thread where needed).
            read_ahead_bytes: reads of the next submodules in flight while one is assigned (default 64 MiB; 0: none).
            tp_plan: tensor parallelism: ``"auto"`` (the model's own plan: ``_tp_plan`` merged with
                ``config.base_model_tp_plan``) or a dict of rules overriding it. Under a process group (or
                torchrun) the model is sharded by transformers' TP engine and each rank reads only its slices;
                see ``lowmem_hf.distributed.tp``.
            tp_size, tp_rank: default to the process group's. Without a group, both given: load only rank
                ``tp_rank``'s slices as plain tensors (no TP forward); ``LoadReport.shards`` describes them.
            device_mesh: a 1-D tp mesh (its size must equal ``tp_size``), or an n-D mesh over every rank whose
                dims are named from ``("dp_replicate", "fsdp", "tp")`` in that order; its sizes become (or must
                agree with) ``distributed_config``'s.
            distributed_config: transformers' ``DistributedConfig(tp_size, fsdp_size, dp_replicate_size, fsdp_plan,
                fsdp_cpu_offload, fsdp_mixed_precision)`` (or a dict of its fields): the model is sharded by
                transformers' own engine (TP, then FSDP2 ``fully_shard``), exactly as ``from_pretrained`` with the same
                config does, and each rank reads only the bytes its DTensor placements own. ``pp_size``/``ep_size``
                above 1 raise ``UnsupportedArgumentError``. See ``lowmem_hf.distributed.mesh``.
            tqdm_class: a tqdm-compatible class for the progress bar, as in transformers.
            fetch: for Hub repos: ``"files"`` downloads into the HF cache only the shard files this rank's plan
                touches; ``"ranges"`` fetches only the planned byte ranges into memory and writes no shard to
                disk (safetensors only; ``.bin`` shards are always fetched whole). Ignored for local folders.
                Under a process group, ``"ranges"`` is the cooperative fetch (``lowmem_hf.sources.exchange``): each byte is
                fetched once by one rank, in spans of at most ``fetch_span_bytes`` (default 16 MiB), and the
                ranks send each other the pieces over the group.
            fetch_span_bytes: the largest span one request of the cooperative fetch asks for.
            verify_downloads: for Hub repos (default ``True``): every file downloaded during the load (the shards of
                ``fetch="files"``, ``.bin`` shards) is hashed before it is read and compared with the sha256 the Hub
                publishes for LFS files (their ETag); a mismatch removes the file from the HF cache and downloads it
                once more, then raises ``CorruptDownloadError``. ``False`` skips the hashing (size and ETag are still
                compared with the plan). Files already in the cache are not hashed again.
            **config_overrides: config attributes to override (``num_labels=3``), or arguments of the model's
                ``__init__``, exactly as transformers routes them.

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
        return load(make_request(cls._auto_class, pretrained_model_name_or_path, *model_args, **kwargs))


# One signature, defined by make_request: shown by help() and IDEs, checked by make_request.
_signature = inspect.signature(make_request)
LowMemAutoModelBase.from_pretrained.__func__.__signature__ = _signature.replace(
    parameters=[inspect.Parameter("cls", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + list(_signature.parameters.values())[1:]
)


def _make_auto_classes() -> dict[str, type]:
    """One ``LowMem<AutoClass>`` per transformers ``AutoModel*`` class, derived from transformers' auto module."""
    classes = {}
    for name, obj in vars(modeling_auto).items():
        if is_auto_class(obj) and name.startswith("AutoModel"):
            doc = (
                f"Drop-in for ``transformers.{name}``: ``from_pretrained`` streams the checkpoint into a meta-built "
                f"model at ~1.0x memory. See ``LowMemAutoModelBase.from_pretrained``."
            )
            classes[f"LowMem{name}"] = type(f"LowMem{name}", (LowMemAutoModelBase,), {"_auto_class": obj, "__doc__": doc, "__module__": __name__})
    return classes


AUTO_CLASSES: dict[str, type] = _make_auto_classes()
globals().update(AUTO_CLASSES)
__all__ += sorted(AUTO_CLASSES)
