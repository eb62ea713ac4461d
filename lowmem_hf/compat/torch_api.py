"""torch names that are private or differ between releases.

Checked against torch 2.11.0, 2.13.0 (CPU) and 2.15.0, the oldest, pinned and newest stacks CI runs.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

from ..errors import UpstreamAPIError

__all__ = [
    "EXTRA_STATE_SUFFIX",
    "strided_split_factor",
    "parameter_slot",
    "has_parameter_slot",
    "put_parameter",
    "put_buffer",
    "default_store",
    "store_values",
    "hf_rank_shard",
]

EXTRA_STATE_SUFFIX: str = getattr(torch.nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")
"""The state-dict suffix of a module's ``get_extra_state()`` entry (``_EXTRA_STATE_KEY_SUFFIX``, ``"_extra_state"``
in every release checked)."""


def strided_split_factor(placement: Any) -> int | None:
    """The ``split_factor`` of a DTensor ``_StridedShard`` placement (FSDP2 sharding a dim TP already sharded), or
    ``None`` for any other placement.

    Told by the attribute rather than by the private class. What a strided shard selects is computed by lowmem_hf
    itself (``distributed.strided_shard_indices``): the method torch offers for it is private and changed signature
    (torch 2.10-2.12 take ``return_first_offset``, 2.13 on an ``offset_mode`` enum that 2.11 lacks; passed
    positionally, one's ``False`` is the other's ``FIRST``). The tests check it against torch's own arithmetic.
    """
    factor = getattr(placement, "split_factor", None)
    return None if factor is None else int(factor)


def has_parameter_slot(module: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is a registered parameter of ``module`` itself (possibly ``None``), not a buffer."""
    return name in module._parameters


def parameter_slot(module: torch.nn.Module, name: str) -> torch.nn.Parameter | None:
    """``module``'s own parameter ``name`` (``None`` where registered empty)."""
    return module._parameters[name]


def put_parameter(module: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    """Replace ``module``'s parameter ``name`` in place, as ``load_state_dict(assign=True)`` does: through the
    parameter dict, so that no hook or ``__setattr__`` check of a wrapper (FSDP2, DeepSpeed) sees a half-built
    module. Every torch release since 1.x keeps parameters in ``Module._parameters``."""
    module._parameters[name] = param


def put_buffer(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace ``module``'s buffer ``name`` in place, keeping its persistence (``Module._buffers``)."""
    module._buffers[name] = value


def default_store() -> Any:
    """The key-value store of the default process group (the one ``init_process_group`` rendezvoused on).

    ``torch.distributed.distributed_c10d._get_default_store``: private in every release checked; the cooperative
    fetch posts its per-wave statuses there, because a store wait has a timeout and names the missing rank.

    Raises:
        UpstreamAPIError: a torch without it.
    """
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        raise UpstreamAPIError(
            "the cooperative fetch's status exchange", needs="torch.distributed.distributed_c10d._get_default_store",
            found=f"torch {torch.__version__}", fix="load with fetch='files' (every rank downloads the files it reads)",
        )
    return getter()


def store_values(store: Any, keys: list[str]) -> list[bytes]:
    """The values of ``keys`` in ``store``, in one round trip where the release has ``Store.multi_get``.

    A status round reads every rank's key: one ``get`` each made every rank's round cost grow with the world (a
    16-rank job: 16 round trips per rank, 256 per round for the job); ``multi_get`` is one per rank. A store
    without it (a release or a Python store that lacks it) is read key by key.
    """
    many = getattr(store, "multi_get", None)
    if many is not None:
        return list(many(keys))
    return [store.get(k) for k in keys]


def hf_rank_shard(rank: int, offsets: dict[str, list[int]]) -> tuple[str, dict[str, str]]:
    """The file name and header metadata DCP's Hugging Face storage writer gives rank ``rank``'s shard of a
    ``distributed_checkpoint=True`` save (``shard-0000r-model-00001-of-00001.safetensors``, each tensor's global
    offsets under the custom key), which transformers' ``from_pretrained(tp_plan=...)`` reads back through
    ``HuggingFaceStorageReader``. The names live in ``torch.distributed.checkpoint._hf_utils``.

    Raises:
        UpstreamAPIError: a torch without that module.
    """
    try:
        from torch.distributed.checkpoint import _hf_utils as h
    except ImportError as e:
        raise UpstreamAPIError(
            "save_pretrained(distributed_checkpoint=True)", needs="torch.distributed.checkpoint._hf_utils",
            found=f"torch {torch.__version__}", fix="save with distributed_checkpoint=False (one gathered checkpoint)",
        ) from e
    metadata = {
        h.CUSTOM_METADATA_KEY: json.dumps({name: {h.SAVED_OFFSETS_KEY: list(o)} for name, o in offsets.items()}),
        h.DCP_VERSION_KEY: str(h.HF_DCP_VERSION),
        h.FORMAT_KEY: h.FORMAT_VALUE,
    }
    return h._gen_file_name(1, 1, rank + 1), metadata
