"""Map checkpoint keys to model keys with transformers' own rules.

The renames, converters and base-model-prefix handling are transformers' (``get_model_conversion_mapping``
and ``rename_source_key``), applied in the same order as ``convert_and_load_state_dict_in_model`` so that
every key lands where transformers would put it, and the same transforms are marked as used (which
``save_pretrained`` reads to write the checkpoint back in its original layout).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
from transformers.conversion_mapping import get_model_conversion_mapping

__all__ = ["KeyMapping", "map_checkpoint_keys"]


@dataclass(frozen=True)
class KeyMapping:
    """Where each checkpoint key goes."""

    direct: Mapping[str, str]
    """Model key -> the one checkpoint key loaded into it unchanged (renamed at most)."""
    converted: Mapping[str, tuple[Any, tuple[tuple[str, str], ...]]]
    """First model key -> (a private copy of the ``WeightConverter``, ``((source_pattern, checkpoint_key), ...)``)."""
    unexpected: frozenset[str]
    """Renamed checkpoint keys the model has no place for."""
    duplicates: tuple[tuple[str, str], ...]
    """``(checkpoint_key, model_key)`` dropped because an earlier key already maps there (transformers keeps the first)."""
    used_transforms: tuple[Any, ...]
    """The transforms that matched at least one key, for ``model._weight_conversions``."""


def map_checkpoint_keys(model: Any, checkpoint_keys: Iterable[str], *, key_mapping: Mapping[str, str] | None) -> KeyMapping:
    """Rename every checkpoint key exactly as transformers 5 does and sort them into direct / converted / unexpected."""
    transforms = get_model_conversion_mapping(model, key_mapping, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    pattern_to_converter = {p: c for c in converters for p in c.source_patterns}
    prefix = model.base_model_prefix
    model_keys = model.state_dict()

    direct: dict[str, str] = {}
    converted: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    unexpected: set[str] = set()
    duplicates: list[tuple[str, str]] = []
    for original in sorted(checkpoint_keys, key=dot_natural_key):
        renamed, source_pattern = rename_source_key(original, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and original in model_keys:
            renamed, source_pattern = rename_source_key(original, [], [], prefix, model_keys)
        if renamed in model_keys:
            if source_pattern is not None:
                entry = converted.setdefault(renamed, (deepcopy(pattern_to_converter[source_pattern]), []))
                entry[1].append((source_pattern, original))
            elif renamed in direct:
                duplicates.append((original, renamed))
            else:
                direct[renamed] = original
        elif source_pattern is not None:
            converter = pattern_to_converter[source_pattern]
            for target in converter.target_patterns:
                unexpected.add(renamed.replace(converter.target_patterns[0], target))
        else:
            unexpected.add(renamed)

    return KeyMapping(
        direct=direct,
        converted={k: (c, tuple(sources)) for k, (c, sources) in converted.items()},
        unexpected=frozenset(unexpected),
        duplicates=tuple(duplicates),
        used_transforms=tuple(t for t in transforms if t.was_used()),
    )
