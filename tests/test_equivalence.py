"""lowmem_hf gives the model transformers' from_pretrained gives, bit for bit, for the same request."""

import pytest
import torch
import transformers

import lowmem_hf
from checkpoints import FORMATS, MODELS

DTYPES = [None, "auto", torch.float32, torch.bfloat16]
CASES = [(name, auto) for name, case in MODELS.items() for auto in case.auto_classes]


def load_both(path, auto_name, **kwargs):
    """(transformers model, loading info), (lowmem model, report) for one request, each after the same seed."""
    torch.manual_seed(1234)
    ref, ref_info = getattr(transformers, auto_name).from_pretrained(path, output_loading_info=True, **kwargs)
    torch.manual_seed(1234)
    got, report = getattr(lowmem_hf, "LowMem" + auto_name).from_pretrained(path, output_loading_info=True, **kwargs)
    return (ref, ref_info), (got, report)


def assert_same_model(ref, got, *, same_source=True):
    assert type(got) is type(ref)
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert list(got_sd) == list(ref_sd)
    for name, expected in ref_sd.items():
        actual = got_sd[name]
        assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device, name
        assert torch.equal(actual, expected), f"{name} differs"
    # Non-persistent buffers (RoPE inv_freq, position ids) are not in the state dict: compare them too.
    ref_buffers, got_buffers = dict(ref.named_buffers()), dict(got.named_buffers())
    assert got_buffers.keys() == ref_buffers.keys()
    for name, expected in ref_buffers.items():
        assert got_buffers[name].dtype == expected.dtype, name
        assert torch.equal(got_buffers[name], expected), f"buffer {name} differs"
    for (name, p_ref), (_, p_got) in zip(ref.named_parameters(), got.named_parameters()):
        assert type(p_got) is type(p_ref) and p_got.requires_grad == p_ref.requires_grad, name
    assert got.training is False and ref.training is False
    # transformers itself leaves config.dtype as a str after some loads: compare by name
    assert str(got.config.dtype).removeprefix("torch.") == str(ref.config.dtype).removeprefix("torch.")
    if same_source:
        assert got.config.to_dict() == ref.config.to_dict()


def assert_same_tying(ref, got):
    """Parameters transformers shares are shared (the same object) here too, and no others."""
    def groups(model):
        by_id = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
        return sorted(sorted(names) for names in by_id.values() if len(names) > 1)

    assert groups(got) == groups(ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case_name,auto_name", CASES)
def test_matches_transformers(make_checkpoint, case_name, auto_name, fmt, dtype):
    path = make_checkpoint(case_name, fmt)
    (ref, ref_info), (got, report) = load_both(path, auto_name, dtype=dtype)

    assert_same_model(ref, got)
    assert_same_tying(ref, got)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert report[key] == set(ref_info[key]), key
    assert got._weight_conversions is not None
    assert [repr(t) for t in got._weight_conversions] == [repr(t) for t in ref._weight_conversions]

    inputs = MODELS[case_name].inputs()
    with torch.no_grad():
        expected, actual = ref(**inputs)[0], got(**inputs)[0]
    assert torch.equal(actual, expected)


def test_head_is_initialized_and_reported_missing(make_checkpoint):
    path = make_checkpoint("bert", "sharded")
    (ref, ref_info), (got, report) = load_both(path, "AutoModelForSequenceClassification", num_labels=3)
    assert got.config.num_labels == 3 and got.classifier.weight.shape == (3, 64)
    assert {"classifier.weight", "classifier.bias"} <= report["missing_keys"]
    assert report["missing_keys"] == set(ref_info["missing_keys"])
    # initialized by BERT's own _init_weights under the same seed: identical to transformers
    assert torch.equal(got.classifier.weight, ref.classifier.weight)
    assert torch.count_nonzero(got.classifier.weight) > 0 and torch.count_nonzero(got.classifier.bias) == 0


def test_legacy_keys_are_renamed_and_saved_back(make_checkpoint, tmp_path):
    path = make_checkpoint("bert_legacy_names", "sharded")
    got = lowmem_hf.LowMemAutoModel.from_pretrained(path)
    assert got.embeddings.LayerNorm.weight.device.type == "cpu"
    got.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    # save_pretrained writes the layout it was loaded from, as it does after transformers' own load
    assert "embeddings.LayerNorm.gamma" in keys and "embeddings.LayerNorm.weight" not in keys


def test_bf16_checkpoint_auto_dtype(make_checkpoint):
    path = make_checkpoint("llama", "sharded", dtype=torch.bfloat16)
    for dtype in (None, "auto"):
        (ref, _), (got, report) = load_both(path, "AutoModelForCausalLM", dtype=dtype)
        assert report.dtype == torch.bfloat16 and got.model.embed_tokens.weight.dtype == torch.bfloat16
        assert_same_model(ref, got)


def test_generate_matches(make_checkpoint):
    path = make_checkpoint("llama", "safetensors")
    (ref, _), (got, _) = load_both(path, "AutoModelForCausalLM", dtype=torch.float32)
    ids = MODELS["llama"].inputs()["input_ids"][:1]
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got.generate(ids, **kwargs), ref.generate(ids, **kwargs))


@pytest.mark.parametrize("case_name,auto_name", [("t5", "AutoModelForSeq2SeqLM"), ("mixtral", "AutoModelForCausalLM"), ("qwen2_tied", "AutoModelForCausalLM")])
def test_save_pretrained_round_trips_through_transformers(make_checkpoint, tmp_path, case_name, auto_name):
    path = make_checkpoint(case_name, "bin")
    got = getattr(lowmem_hf, "LowMem" + auto_name).from_pretrained(path, dtype=torch.bfloat16)
    got.save_pretrained(tmp_path)
    again = getattr(transformers, auto_name).from_pretrained(tmp_path)
    assert_same_model(got, again, same_source=False)
