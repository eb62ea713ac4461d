"""The switch across architectures: every model type of every transformers ``AutoModel*`` class that builds from
a tiny config and round-trips through transformers loads through lowmem_hf bit-identically, params and buffers.

The list is transformers': every ``AutoModel*`` class of ``transformers.models.auto.modeling_auto`` and the model
types of its mapping (``AutoModelForSequenceClassification`` -> ``MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES``,
...), so a new transformers release brings its new classes and types here.
A type is skipped, with the reason, when it cannot be built tiny from its config defaults (``tiny_models``)
or when transformers' own save/load round trip of it fails or is not exact: that is transformers' limit,
not the switch's. Everything else must load through lowmem_hf (no fallback) and equal transformers' load.

Which cases run is ``LOWMEM_SWEEP``:

- ``sample`` (default, what CI runs): every type of ``AutoModel``, ``AutoModelForCausalLM`` and
  ``AutoModelForSeq2SeqLM``, plus, for every other ``AutoModel*`` class, its ``SAMPLE_PER_MAPPING`` types with
  the smallest stable hash of (class, type). The same cases every run, on every machine.
- ``full``: every (class, type) pair::

      LOWMEM_SWEEP=full pytest tests/test_switch_architectures.py

Numbers per auto class (loaded / skipped by reason / failed): ``python benchmarks/sweep_architectures.py [--full]``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import shutil
import warnings

import pytest
import torch
from transformers import PreTrainedConfig
from transformers.models.auto import modeling_auto
from transformers.models.auto.auto_factory import _BaseAutoModelClass

import lowmem_hf
from lowmem_hf.patch import FallbackWarning
from tiny_models import parameter_count, tiny_config

# auto class name -> the class. Its model types are the keys of the names table its lazy mapping wraps
# (``MODEL_FOR_..._MAPPING_NAMES``, model_type -> class name): read without importing any modeling module.
AUTO_CLASSES: dict[str, type] = {
    name: obj for name, obj in sorted(vars(modeling_auto).items())
    if name.startswith("AutoModel") and isinstance(obj, type) and issubclass(obj, _BaseAutoModelClass)
}
MAPPINGS: dict[str, list[str]] = {name: sorted(auto._model_mapping._model_mapping) for name, auto in AUTO_CLASSES.items()}

# Swept whole in the sample: the classes most scripts load (the sweep's coverage before it spanned every class).
ALWAYS_WHOLE = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM")
SAMPLE_PER_MAPPING = 6
SWEEP = os.environ.get("LOWMEM_SWEEP", "sample")
MAX_PARAMETERS = 3_000_000  # what "tiny" means here: a few MB, built and loaded in well under a second

# The skip reasons start with one of these; benchmarks/sweep_architectures.py groups by them.
CANNOT_BUILD = "cannot be built from a tiny config"
NOT_TINY = "not tiny after the generic shrink"
TRANSFORMERS_FAILS = "transformers' own build/save/load fails"
TRANSFORMERS_INEXACT = "transformers' own round trip is not exact"


def _stable_rank(auto_name: str, model_type: str) -> str:
    # not hash(): str hashes are salted per process, and the sample must be the same on every run and machine
    return hashlib.sha256(f"{auto_name}/{model_type}".encode()).hexdigest()


def select_cases(sweep: str) -> list[tuple[str, str]]:
    """The (auto class, model type) pairs of a ``full`` or ``sample`` sweep, in a fixed order."""
    if sweep not in ("sample", "full"):
        raise ValueError(f"LOWMEM_SWEEP={sweep!r}; expected 'sample' (the default) or 'full'")
    cases = []
    for auto_name, types in MAPPINGS.items():
        if sweep == "sample" and auto_name not in ALWAYS_WHOLE:
            types = sorted(sorted(types, key=lambda t: _stable_rank(auto_name, t))[:SAMPLE_PER_MAPPING])
        cases += [(auto_name, model_type) for model_type in types]
    return cases


CASES = select_cases(SWEEP)


@functools.cache
def _cached_tiny_config(model_type: str) -> PreTrainedConfig | BaseException:
    try:
        return tiny_config(model_type)
    except Exception as error:  # noqa: BLE001 - becomes the skip reason of every class of this type
        return error


def _tiny_config(model_type: str) -> PreTrainedConfig:
    """``tiny_config(model_type)``, computed once per type for every auto class; a fresh copy each call."""
    config = _cached_tiny_config(model_type)
    if isinstance(config, BaseException):
        raise config
    return copy.deepcopy(config)  # from_config may write to the config it is given


def _first_line(error: BaseException) -> str:
    text = [line.strip() for line in str(error).strip().splitlines()]
    if len(text) > 1 and text[0].endswith(":"):  # "Class validation error for validator 'x':" says little alone
        text[0] = f"{text[0]} {text[1]}"
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _tensors(model) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(("buffer:" + k, v) for k, v in model.named_buffers(remove_duplicate=False))
    return named


def _difference(ref, got) -> str | None:
    """The first way ``got``'s params/buffers differ from ``ref``'s, or None if bit-identical."""
    a, b = _tensors(ref), _tensors(got)
    if a.keys() != b.keys():
        return f"names differ: {sorted(a.keys() ^ b.keys())[:5]}"
    for name, t in a.items():
        u = b[name]
        if (t.dtype, t.shape, u.device.type) != (u.dtype, u.shape, t.device.type):
            return f"{name}: {t.dtype}{tuple(t.shape)} vs {u.dtype}{tuple(u.shape)} on {u.device}"
        if not torch.equal(t, u) and not (t.is_floating_point() and torch.equal(t.isnan(), u.isnan())
                                          and torch.equal(t.nan_to_num(), u.nan_to_num())):
            return f"{name}: values differ"
    return None


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("architectures")


def test_sample_covers_every_auto_class_and_the_whole_original_sweep():
    sample = set(select_cases("sample"))
    for auto_name, types in MAPPINGS.items():
        chosen = {t for a, t in sample if a == auto_name}
        assert len(chosen) >= min(len(types), SAMPLE_PER_MAPPING), auto_name
        if auto_name in ALWAYS_WHOLE:
            assert chosen == set(types), auto_name
    assert select_cases("sample") == select_cases("sample") and sample <= set(select_cases("full"))


@pytest.mark.parametrize("auto_name,model_type", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_switch_loads_every_architecture_like_transformers(auto_name, model_type, root):
    auto = AUTO_CLASSES[auto_name]
    try:
        config = _tiny_config(model_type)
        with torch.device("meta"):
            size = parameter_count(auto.from_config(config))
    except Exception as error:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"{CANNOT_BUILD}: {_first_line(error)}")
    if size > MAX_PARAMETERS:
        pytest.skip(f"{NOT_TINY}: {size:,} parameters")

    folder = root / f"{auto_name}-{model_type}"
    try:
        try:
            torch.manual_seed(0)
            built = auto.from_config(config)
            built.save_pretrained(folder)
            torch.manual_seed(0)
            ref = auto.from_pretrained(folder)
        except Exception as error:  # noqa: BLE001
            pytest.skip(f"{TRANSFORMERS_FAILS}: {_first_line(error)}")
        if (why := _difference(built, ref)) is not None:
            pytest.skip(f"{TRANSFORMERS_INEXACT}: {why}")

        with lowmem_hf.patch_transformers(), warnings.catch_warnings():
            warnings.simplefilter("error", FallbackWarning)  # the switch must not hand this type back
            torch.manual_seed(0)
            got = auto.from_pretrained(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # thousands of checkpoints in a full sweep
    assert type(got) is type(ref) and hasattr(got, "lowmem_report")
    assert _difference(ref, got) is None, _difference(ref, got)
