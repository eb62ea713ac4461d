"""The dtype policy: who wins when a checkpoint tensor's dtype and the declared dtype differ.

Rules, first match wins:

1. ``dtype_overrides`` — the caller's ordered ``(glob, dtype)`` list, matched with ``fnmatch`` against
   the parameter's name. Applies to floating-point tensors only, and chooses only ``FLOAT_DTYPES``.
2. The model's own fp32 declarations, exactly as transformers applies them: ``_keep_in_fp32_modules``
   when the reference dtype is float16, ``_keep_in_fp32_modules_strict`` when it is float16 or bfloat16.
   The reference dtype is the declared dtype under ``"declared"`` and the stored dtype under ``"loaded"``.
3. ``"declared"``: the module's dtype as built under the declared default dtype (transformers: a module
   that hard-codes another dtype keeps it), else the declared dtype.
   ``"loaded"``: the stored dtype; a floating one outside ``FLOAT_DTYPES`` (float8) is an error.

No rule chooses a dtype transformers would not load a floating tensor into (``FLOAT_DTYPES``).

The declared dtype is ``torch_dtype`` when given, else the config's/checkpoint's when ``"auto"``/``None``,
decided by transformers' own ``_get_dtype``. Nothing here depends on the model having been built on ``meta``:
the module dtypes are the ones a real construction gives.
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from transformers.core_model_loading import build_glob_alternation

from ..compat.transformers_api import dtype_plan
from ..errors import UnsupportedArgumentError
from ..types import DtypeDecision

__all__ = [
    "DTYPE_POLICIES", "FLOAT_DTYPES", "DtypePolicy", "check_dtype_policy", "check_float_dtype", "parse_dtype", "parse_overrides",
    "requested_dtype",
]

DTYPE_POLICIES = ("declared", "loaded")

# The dtypes transformers loads a floating tensor into: it builds the model under ``torch.set_default_dtype(dtype)``
# (``local_torch_dtype``), which torch accepts for these four only (float8 fails on a missing storage class,
# integer and complex dtypes are refused), and it casts every floating checkpoint tensor to its parameter's dtype.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_DTYPE_NAMES = sorted(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


def parse_dtype(value: Any, *, argument: str) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or its name (``"bfloat16"``, ``"torch.float16"``), as transformers accepts."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return getattr(torch, name)
        close = difflib.get_close_matches(name, _DTYPE_NAMES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{argument}={value!r} is not a torch dtype.{hint} Use a torch.dtype or its name, "
            "e.g. torch.bfloat16 or 'bfloat16'"
            + (", or 'auto' for the checkpoint's dtype." if argument in ("torch_dtype", "dtype") else ".")
        )
    raise TypeError(f"{argument} must be a torch.dtype or its name, got {type(value).__name__} {value!r}.")


def check_float_dtype(dtype: torch.dtype, *, argument: str) -> torch.dtype:
    """``dtype`` if it is one of ``FLOAT_DTYPES``, else a ``ValueError`` naming ``argument`` (``torch_dtype``,
    ``dtype_overrides['*.weight']``...)."""
    if dtype not in FLOAT_DTYPES:
        if dtype == torch.bool:
            kind = "a boolean dtype"
        elif dtype.is_complex:
            kind = "a complex dtype"
        elif dtype.is_floating_point:
            kind = "a float format that transformers reaches only through a quantization_config"
        else:
            kind = "an integer dtype"
        raise ValueError(
            f"{argument}={dtype}: transformers loads floating tensors only into "
            f"{', '.join(str(d) for d in FLOAT_DTYPES[:-1])} or {FLOAT_DTYPES[-1]}, and {dtype} is {kind}. "
            "Choose one of those."
        )
    return dtype


def check_dtype_policy(mode: Any) -> None:
    """Raise ``ValueError`` (with the closest policy) unless ``mode`` is one of ``DTYPE_POLICIES``."""
    if mode not in DTYPE_POLICIES:
        close = difflib.get_close_matches(str(mode), DTYPE_POLICIES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"dtype_policy={mode!r} is not a policy.{hint} Use 'declared' (every tensor gets the declared "
            "torch_dtype) or 'loaded' (every tensor keeps its checkpoint dtype)."
        )


def parse_overrides(overrides: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> tuple[tuple[str, torch.dtype], ...]:
    """Normalize ``dtype_overrides`` (a dict in insertion order, or a list of pairs) to ``((glob, dtype), ...)``."""
    if overrides is None:
        return ()
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    out = []
    for item in items:
        try:
            pattern, dtype = item
        except (TypeError, ValueError):
            raise TypeError(
                f"dtype_overrides entries must be (glob, dtype) pairs, got {item!r}; "
                "e.g. {'*.norm.weight': torch.float32}."
            ) from None
        if not isinstance(pattern, str):
            raise TypeError(f"dtype_overrides pattern must be a str glob, got {pattern!r}.")
        # overrides apply to floating tensors only, so an integer dtype would cast float weights (int8: garbage)
        argument = f"dtype_overrides[{pattern!r}]"
        out.append((pattern, check_float_dtype(parse_dtype(dtype, argument=argument), argument=argument)))
    return tuple(out)


def _fp32_matcher(model: Any, reference: torch.dtype):
    """transformers' keep-in-fp32 regex for a model at ``reference`` dtype (``None`` when no rule applies)."""
    plan = dtype_plan(model, reference)
    if not plan:
        return None
    alternation, _, _ = build_glob_alternation(list(plan))
    return alternation


@dataclass(frozen=True)
class DtypePolicy:
    """Decides each tensor's dtype. Build with ``DtypePolicy.for_model``."""

    mode: str
    """``"declared"`` or ``"loaded"``."""
    dtype: torch.dtype
    """The declared model dtype (``config.dtype``)."""
    overrides: tuple[tuple[str, torch.dtype], ...]
    fp32_matchers: Mapping[torch.dtype, Any]
    """Reference dtype -> transformers' keep-in-fp32 regex (or ``None``)."""
    strict_only: Mapping[torch.dtype, bool]
    """Reference dtype -> whether only the ``_strict`` list applies at that dtype (for the rule name)."""

    @classmethod
    def for_model(cls, model: Any, *, mode: str, dtype: torch.dtype, overrides=None) -> "DtypePolicy":
        check_dtype_policy(mode)
        references = (torch.float16, torch.bfloat16, torch.float32, dtype)
        matchers = {ref: _fp32_matcher(model, ref) for ref in references}
        strict_only = {ref: ref != torch.float16 for ref in references}
        return cls(mode=mode, dtype=dtype, overrides=parse_overrides(overrides), fp32_matchers=matchers, strict_only=strict_only)

    def decide(self, name: str, *, stored: torch.dtype, module: torch.dtype) -> DtypeDecision:
        """The dtype of model tensor ``name`` stored as ``stored`` whose module builds it as ``module``."""
        floating = stored.is_floating_point and module.is_floating_point
        if floating:
            for pattern, dtype in self.overrides:
                if fnmatch.fnmatchcase(name, pattern):
                    return DtypeDecision(dtype, f"override:{pattern}")
            reference = self.dtype if self.mode == "declared" else stored
            # Dtypes other than fp16/bf16 (fp32, fp64...) have no fp32 rule in transformers.
            matcher = self.fp32_matchers.get(reference)
            if matcher is not None and matcher.search(name):
                rule = "keep_in_fp32_strict" if self.strict_only[reference] else "keep_in_fp32"
                return DtypeDecision(torch.float32, rule)
        if self.mode == "loaded":
            if floating and stored not in FLOAT_DTYPES:
                raise ValueError(
                    f"{name} is stored as {stored}; dtype_policy='loaded' keeps checkpoint dtypes, but transformers "
                    f"loads floating tensors only into {', '.join(str(d) for d in FLOAT_DTYPES)}. Use "
                    f"dtype_policy='declared' (casts it to {self.dtype}) or a dtype_overrides entry for {name!r}."
                )
            return DtypeDecision(stored, "loaded")
        if module != self.dtype:
            return DtypeDecision(module, "module")
        return DtypeDecision(self.dtype, "declared")

    def override_for(self, name: str) -> DtypeDecision | None:
        """The override that applies to a tensor the checkpoint does not hold (initialized, not loaded)."""
        for pattern, dtype in self.overrides:
            if fnmatch.fnmatchcase(name, pattern):
                return DtypeDecision(dtype, f"override:{pattern}")
        return None


def requested_dtype(torch_dtype: Any, dtype: Any) -> Any:
    """The declared dtype of ``torch_dtype``/``dtype`` (transformers 5's two names for it): ``"auto"`` or a float
    ``torch.dtype``."""
    if torch_dtype is not None and dtype is not None and torch_dtype != dtype:
        raise ValueError(f"torch_dtype={torch_dtype!r} and dtype={dtype!r} disagree; pass one of them.")
    requested = dtype if dtype is not None else torch_dtype
    if requested is None:
        requested = "auto"  # transformers 5's default
    if isinstance(requested, dict):
        raise UnsupportedArgumentError("dtype", "a per-sub-config dtype dict is not supported; use dtype_overrides.")
    if requested != "auto":
        argument = "torch_dtype" if torch_dtype is not None else "dtype"
        requested = check_float_dtype(parse_dtype(requested, argument=argument), argument=argument)
    return requested
