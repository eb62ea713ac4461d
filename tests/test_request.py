"""The request object and the two halves of the recipe: prepare reads headers only, execute finishes the load."""

import pytest
import torch
import transformers

import lowmem_hf
from lowmem_hf import UnsupportedArgumentError, execute, make_request, prepare


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def test_unsupported_argument_names_itself():
    with pytest.raises(UnsupportedArgumentError, match="quantization_config") as e:
        make_request(transformers.AutoModelForCausalLM, "x", quantization_config={})
    assert e.value.argument == "quantization_config"
    with pytest.raises(UnsupportedArgumentError, match="device_map='auto'") as e:
        make_request(transformers.AutoModelForCausalLM, "x", device_map="auto")
    assert e.value.argument == "device_map"


def test_request_is_frozen_and_validated_early():
    request = make_request(transformers.AutoModelForCausalLM, "x", torch_dtype="bfloat16", dtype_overrides={"*.norm.weight": "float32"})
    assert request.dtype is torch.bfloat16 and request.dtype_overrides == (("*.norm.weight", torch.float32),)
    with pytest.raises(AttributeError):
        request.dtype = torch.float32
    with pytest.raises(ValueError, match="dtype_policy='declard'.*Did you mean 'declared'"):
        make_request(transformers.AutoModelForCausalLM, "x", dtype_policy="declard")


def test_prepare_reads_no_tensor_bytes_and_execute_finishes(make_checkpoint):
    path = make_checkpoint("llama", "sharded")
    request = make_request(transformers.AutoModelForCausalLM, path, torch_dtype=torch.bfloat16)
    prepare(request)  # first call pays lazy imports, which count in rchar
    before = _rchar()
    prepared = prepare(request)
    read = _rchar() - before
    body = sum(r.source.nbytes for r in prepared.plan.reads)
    assert all(p.device.type == "meta" for p in prepared.model.parameters())
    assert read < body / 4, f"prepare read {read} bytes; the tensor bodies are {body}"

    model, report = execute(prepared)
    expected = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), expected.state_dict().items()):
        assert torch.equal(ours, theirs), name
    assert report.bytes_read >= body


def test_a_concrete_class_request_returns_that_class(make_checkpoint):
    path = make_checkpoint("llama", "safetensors")

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    model = lowmem_hf.load.load(make_request(MyLlama, path))
    assert type(model) is MyLlama
    expected = MyLlama.from_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
