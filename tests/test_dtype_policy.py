"""The dtype policy: declared vs loaded, ordered overrides, and the model's keep-in-fp32 declarations."""

import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from lowmem_hf.auto import AUTO_CLASSES
from lowmem_hf.plan.dtypes import parse_overrides

Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]
Seq2Seq = AUTO_CLASSES["LowMemAutoModelForSeq2SeqLM"]


@pytest.fixture(scope="module")
def mixed_llama(make_checkpoint, tmp_path_factory):
    """A bf16 Llama checkpoint whose norm weights are stored in fp32 (as some trainers save them)."""
    src = make_checkpoint("llama", "safetensors", dtype=torch.bfloat16)
    dst = tmp_path_factory.mktemp("mixed")
    for name in os.listdir(src):
        if name != "model.safetensors":
            with open(os.path.join(src, name), "rb") as f, open(dst / name, "wb") as g:
                g.write(f.read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors = {k: v.float() if "norm" in k else v for k, v in tensors.items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst, tensors


def test_declared_casts_everything_like_transformers(mixed_llama):
    path, _ = mixed_llama
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got, report = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, output_loading_info=True)
    for name, t in ref.state_dict().items():
        assert got.state_dict()[name].dtype == t.dtype == torch.bfloat16 and torch.equal(got.state_dict()[name], t)
    assert report.dtype_decisions["model.norm.weight"].rule == "declared"


def test_loaded_keeps_each_checkpoint_dtype(mixed_llama):
    path, stored = mixed_llama
    got, report = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, dtype_policy="loaded", output_loading_info=True)
    sd = got.state_dict()
    for name, t in stored.items():
        assert sd[name].dtype == t.dtype, name
        assert torch.equal(sd[name], t), name
    assert report.dtype_decisions["model.norm.weight"].dtype == torch.float32
    assert report.dtype_decisions["model.norm.weight"].rule == "loaded"
    assert got.config.dtype == torch.bfloat16  # the declared model dtype is still the config's


def test_overrides_are_ordered_and_beat_the_policy(mixed_llama):
    path, stored = mixed_llama
    overrides = [("model.norm.weight", torch.float16), ("*norm.weight", torch.float32), ("*", torch.bfloat16)]
    got, report = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, dtype_overrides=overrides, output_loading_info=True)
    assert got.model.norm.weight.dtype == torch.float16
    assert report.dtype_decisions["model.norm.weight"].rule == "override:model.norm.weight"
    assert got.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert torch.equal(got.model.layers[0].input_layernorm.weight, stored["model.layers.0.input_layernorm.weight"])
    assert got.lm_head.weight.dtype == torch.bfloat16


def test_overrides_apply_to_initialized_tensors(make_checkpoint):
    path = make_checkpoint("bert", "sharded")
    cls = AUTO_CLASSES["LowMemAutoModelForSequenceClassification"]
    got = cls.from_pretrained(path, torch_dtype=torch.bfloat16, dtype_overrides={"classifier.*": torch.float32})
    assert got.classifier.weight.dtype == torch.float32  # missing from the checkpoint, initialized, then cast


def test_overrides_validate_their_dtypes():
    with pytest.raises(ValueError, match=r"dtype_overrides\['x'\]='f32' is not a torch dtype"):
        parse_overrides({"x": "f32"})
    with pytest.raises(TypeError, match="pairs"):
        parse_overrides(["x"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keep_in_fp32_modules_follow_transformers(make_checkpoint, dtype):
    # T5 declares _keep_in_fp32_modules = ["wo"]: fp32 at fp16 only, as in transformers.
    path = make_checkpoint("t5", "sharded")
    ref = transformers.AutoModelForSeq2SeqLM.from_pretrained(path, dtype=dtype)
    got, report = Seq2Seq.from_pretrained(path, torch_dtype=dtype, output_loading_info=True)
    wo = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    expected = torch.float32 if dtype == torch.float16 else dtype
    assert ref.state_dict()[wo].dtype == expected == got.state_dict()[wo].dtype
    assert report.dtype_decisions[wo].rule == ("keep_in_fp32" if dtype == torch.float16 else "declared")
    for name, t in ref.state_dict().items():
        assert got.state_dict()[name].dtype == t.dtype and torch.equal(got.state_dict()[name], t), name


def test_loaded_policy_applies_keep_in_fp32_to_fp16_tensors(make_checkpoint):
    path = make_checkpoint("t5", "safetensors", dtype=torch.float16)
    got, report = Seq2Seq.from_pretrained(path, dtype_policy="loaded", output_loading_info=True)
    assert got.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
    assert got.encoder.block[0].layer[1].DenseReluDense.wi.weight.dtype == torch.float16
