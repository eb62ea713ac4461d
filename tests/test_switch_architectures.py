"""The switch across architectures: every model type of transformers' own auto mappings that builds from a
tiny config and round-trips through transformers loads through lowmem_hf bit-identically, params and buffers.

The list is transformers' (``MODEL_MAPPING_NAMES``, ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``,
``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``), so a new transformers release brings its new types here.
A type is skipped, with the reason, when it cannot be built tiny from its config defaults (``tiny_models``)
or when transformers' own save/load round trip of it fails or is not exact: that is transformers' limit,
not the switch's. Everything else must load through lowmem_hf (no fallback) and equal transformers' load.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import lowmem_hf
from lowmem_hf.patch import FallbackWarning
from tiny_models import parameter_count, tiny_config

MAPPINGS = {
    "AutoModel": modeling_auto.MODEL_MAPPING_NAMES,
    "AutoModelForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    "AutoModelForSeq2SeqLM": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
}
CASES = [(auto, model_type) for auto, names in MAPPINGS.items() for model_type in sorted(names)]
MAX_PARAMETERS = 3_000_000  # what "tiny" means here: a few MB, built and loaded in well under a second


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:160] if text else ''}"


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


@pytest.mark.parametrize("auto_name,model_type", CASES, ids=[f"{a}-{t}" for a, t in CASES])
def test_switch_loads_every_architecture_like_transformers(auto_name, model_type, root):
    auto = getattr(transformers, auto_name)
    try:
        config = tiny_config(model_type)
        with torch.device("meta"):
            size = parameter_count(auto.from_config(config))
    except Exception as error:  # noqa: BLE001 - the reason is the skip message
        pytest.skip(f"cannot be built from a tiny config: {_first_line(error)}")
    if size > MAX_PARAMETERS:
        pytest.skip(f"not tiny after the generic shrink: {size:,} parameters")

    folder = root / f"{auto_name}-{model_type}"
    try:
        torch.manual_seed(0)
        built = auto.from_config(config)
        built.save_pretrained(folder)
        torch.manual_seed(0)
        ref = auto.from_pretrained(folder)
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"transformers' own build/save/load fails: {_first_line(error)}")
    if (why := _difference(built, ref)) is not None:
        pytest.skip(f"transformers' own round trip is not exact: {why}")

    with lowmem_hf.patch_transformers(), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # the switch must not hand this type back
        torch.manual_seed(0)
        got = auto.from_pretrained(folder)
    assert type(got) is type(ref) and hasattr(got, "lowmem_report")
    assert _difference(ref, got) is None, _difference(ref, got)
