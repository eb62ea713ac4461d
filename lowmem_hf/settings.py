"""What lowmem_hf reads from the environment, and the defaults more than one module shares: each in one place.

Environment variables are read by functions, at the moment of use, as transformers and torchrun's users expect:
a test or a launcher may set them after ``import lowmem_hf``.
"""

from __future__ import annotations

import os

from transformers.utils.import_utils import is_env_variable_true

__all__ = [
    "DEFAULT_SPAN_BYTES", "async_load", "gpu_convert_on_device", "gpu_overlap", "launcher_rank", "launcher_world_size", "local_rank", "local_world_size",
    "proc_status", "proc_status_bytes", "store_cache_dir",
]

DEFAULT_SPAN_BYTES = 16 * 1024 * 1024
"""The largest byte range one request of a cooperative Hub fetch asks for (``fetch_span_bytes``)."""


def async_load() -> bool:
    """transformers' switch, read as it reads it: ``HF_DEACTIVATE_ASYNC_LOAD=1`` loads and downloads on the calling
    thread, starting no thread."""
    return not is_env_variable_true("HF_DEACTIVATE_ASYNC_LOAD")


def store_cache_dir() -> str:
    """Where an object-store load keeps the checkpoint's small files (config, index, tokenizer) and the objects it
    reads whole (``.bin`` shards, DCP files): ``LOWMEM_HF_STORE_CACHE``, else ``$HF_HOME/lowmem_hf/store``."""
    if os.environ.get("LOWMEM_HF_STORE_CACHE"):
        return os.environ["LOWMEM_HF_STORE_CACHE"]
    from huggingface_hub import constants  # HF_HOME as huggingface_hub resolves it (XDG_CACHE_HOME included)

    return os.path.join(constants.HF_HOME, "lowmem_hf", "store")


def gpu_overlap() -> bool | None:
    """``LOWMEM_HF_GPU_OVERLAP``, for loads onto a CUDA device: ``1`` (the default where unset) gives each reader
    thread two pinned staging buffers used in turn, its copies to the device issued on a side stream without waiting,
    so the next chunk is read while the previous one is copied; ``0``: one buffer per thread, whose next read waits
    for its copy (with ``LOWMEM_HF_GPU_CONVERT_ON_DEVICE=0`` too: a blocking ``copy_``). None where unset."""
    return _switch("LOWMEM_HF_GPU_OVERLAP")


def gpu_convert_on_device() -> bool | None:
    """``LOWMEM_HF_GPU_CONVERT_ON_DEVICE``, for loads onto a CUDA device: ``1`` (the default where unset) copies a
    chunk whose dtype changes, or whose runs are strided, to the device as its stored bytes (into a reused device
    buffer per reader thread) and converts or gathers it there; ``0`` leaves it to ``copy_`` (which converts on the
    host when the copy blocks). None where unset."""
    return _switch("LOWMEM_HF_GPU_CONVERT_ON_DEVICE")


def _switch(name: str) -> bool | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: expected 0 (off) or 1 (on), or unset (on where it applies).")
    return value == "1"


def launcher_rank() -> int | None:
    """torchrun's ``RANK``; None outside a launcher."""
    return int(os.environ["RANK"]) if "RANK" in os.environ else None


def launcher_world_size() -> int | None:
    """torchrun's ``WORLD_SIZE`` when a launcher set both ``RANK`` and ``WORLD_SIZE``; None outside a launcher."""
    return int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def local_rank() -> int:
    """torchrun's ``LOCAL_RANK`` (0 outside a launcher): the process of a node that draws progress bars."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (1 outside a launcher): the ranks that share this node's cores."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def proc_status(pid: int | str = "self", fields: tuple[str, ...] | None = None) -> dict[str, int]:
    """The fields of ``/proc/<pid>/status`` counted in kB (``RssAnon``, ``VmHWM``, ``VmRSS``...), in kB: those
    named in ``fields`` that the file has, or all of them. Naming them costs a lookup each instead of a parse of
    every line, which matters to callers that sample while a load runs.

    Raises:
        OSError: there is no such file (not Linux, or the process is gone); a sampler tells a child that exited
            from one that holds nothing by it.
    """
    with open(f"/proc/{pid}/status", "rb") as f:
        data = f.read()
    if fields is None:
        fields = tuple(line.partition(b":")[0].decode() for line in data.splitlines() if line.endswith(b" kB"))
    found = {}
    for field in fields:
        start = data.find(b"\n" + field.encode() + b":")  # every kB field follows another line
        if start >= 0:
            end = data.find(b"\n", start + 1)
            found[field] = int(data[start + len(field) + 2:end if end >= 0 else None].split()[0])
    return found


def proc_status_bytes(field: str, pid: int | str = "self") -> int:
    """One memory field of ``/proc/<pid>/status`` (``RssAnon``, ``VmHWM``...) in bytes; 0 where there is none
    (not Linux, or the process is gone)."""
    try:
        return proc_status(pid, (field,)).get(field, 0) * 1024
    except OSError:
        return 0
