"""The load device: the one ``torch.device`` a model goes to, from ``device`` and ``device_map``.

lowmem_hf places the whole model on one device, so a ``device_map`` is accepted only where it names one device;
with neither argument the ambient device decides, exactly as transformers decides it.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnsupportedArgumentError, short_repr

__all__ = ["load_device"]


def load_device(device: Any, device_map: Any) -> torch.device:
    """The one device the model goes to, from ``device`` and/or a single-device ``device_map``.

    With neither, the ambient device decides, exactly as in transformers (its own ``check_and_set_device_map``):
    a ``with torch.device(...)`` block or ``torch.set_default_device(...)`` is the load device, ``"cuda"`` means
    this process's ``LOCAL_RANK``, and ``meta`` raises transformers' ``RuntimeError``. A ``meta`` passed as
    ``device`` or ``device_map`` is ``UnsupportedArgumentError`` (the switch hands ``device_map='meta'`` to
    transformers, which builds a model with no weights).
    """
    chosen = _device_from(device, device_map)
    if device is not None or device_map is not None:  # the ambient device fails as transformers fails on it
        _check_available(chosen, f"device={short_repr(device)}" if device is not None else f"device_map={short_repr(device_map)}")
    return chosen


def _check_available(device: torch.device, shown: str) -> None:
    """A device this torch build has (``torch.cuda.is_available()``...): else torch fails deep inside the load (an
    ``AssertionError: Torch not compiled with CUDA enabled`` at the first allocation)."""
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if device.type != "cpu" and callable(available) and not available():
        raise ValueError(
            f"{shown} is {device}, but this process has no {device.type} device (torch.{device.type}.is_available() is "
            f"False; torch {torch.__version__}). Pass device='cpu', or run where {device.type} is available."
        )


def _device_from(device: Any, device_map: Any) -> torch.device:
    given = device_map
    if device is None:  # ``device`` is lowmem_hf's own argument; transformers knows only device_map
        from transformers.integrations.accelerate import check_and_set_device_map

        device_map = check_and_set_device_map(device_map)
    if device_map is not None:
        if isinstance(device_map, dict):
            values = set(str(_parse_device(v, "device_map", given)) if v != "disk" else v for v in device_map.values())
            if len(values) != 1:
                raise UnsupportedArgumentError(
                    "device_map",
                    f"device_map={device_map!r} spreads the model over {sorted(values)}; lowmem_hf places the "
                    "whole model on one device. Pass device='cuda:0' (or a one-device map like {'': 0}).",
                )
            mapped = next(iter(device_map.values()))
        elif isinstance(device_map, str) and device_map in ("auto", "balanced", "balanced_low_0", "sequential"):
            raise UnsupportedArgumentError(
                "device_map",
                f"device_map={device_map!r} dispatches the model across devices, which lowmem_hf does not do. "
                "Pass one device, e.g. device_map='cuda:0' or device='cpu'.",
            )
        else:
            mapped = device_map
        if mapped == "disk":
            raise UnsupportedArgumentError("device_map", "device_map='disk' (disk offload) is not supported; load to 'cpu'.")
        mapped = _parse_device(mapped, "device_map", given)
        if device is not None and _parse_device(device, "device") != mapped:
            raise ValueError(f"device={device!r} and device_map={device_map!r} disagree; pass one of them.")
        return mapped
    return _parse_device(device, "device") if device is not None else torch.device("cpu")


def _parse_device(value: Any, argument: str, given: Any = None) -> torch.device:
    """One device from ``device`` or a ``device_map`` value (an int is a CUDA index, as in transformers); ``given``
    is the argument as the caller passed it, for the message."""
    shown = short_repr(given if given is not None else value)
    try:
        device = torch.device(f"cuda:{value}" if isinstance(value, int) and not isinstance(value, bool) else value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"{argument}={shown} is not a device; pass 'cpu', 'cuda', 'cuda:0', a CUDA index or a torch.device."
        ) from None
    if device.type == "meta":
        raise UnsupportedArgumentError(
            argument,
            f"{argument}={shown} would give a model with no weights, and lowmem_hf loads weights. For an empty model "
            "use `with torch.device('meta'): AutoModelForCausalLM.from_config(config)`; to load, pass device='cpu' or "
            "a CUDA device.",
        )
    return device
