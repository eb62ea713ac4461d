"""Every argument is checked with a named error (the argument, the value, the fix), before anything is read; and
transformers' own config errors come out naming the config file and the field."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import lowmem_hf
from lowmem_hf import UnsupportedArgumentError, make_request
from lowmem_hf.patch import FallbackWarning

Auto = transformers.AutoModelForCausalLM
load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained
NOT_LOADED = [torch.int8, torch.uint8, torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture
def llama(make_checkpoint, tmp_path):
    """A copy of the tiny Llama checkpoint whose config.json a test may edit."""
    path = tmp_path / "llama"
    shutil.copytree(make_checkpoint("llama", "safetensors"), path)
    return path


def _edit_config(path, **changes) -> str:
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(changes)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return config_file


@pytest.mark.parametrize("dtype", NOT_LOADED, ids=str)
def test_dtype_overrides_refuse_a_dtype_transformers_never_loads_floats_into(dtype):
    with pytest.raises(ValueError, match=rf"dtype_overrides\['\*\.weight'\]={dtype}: transformers loads floating tensors only into"):
        make_request(Auto, "x", dtype_overrides={"*.weight": dtype})


def test_dtype_override_int8_used_to_cast_every_weight(llama):
    with pytest.raises(ValueError, match=r"dtype_overrides\['\*\.weight'\]=torch\.int8.*integer dtype"):
        load(llama, dtype_overrides={"*.weight": torch.int8})


@pytest.mark.parametrize("argument", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8, torch.complex64], ids=str)
def test_the_declared_dtype_must_be_one_transformers_builds_models_in(argument, dtype):
    with pytest.raises(ValueError, match=rf"^{argument}={dtype}: transformers loads floating tensors only into .*Choose one"):
        make_request(Auto, "x", **{argument: dtype})


def test_dtype_policy_loaded_refuses_a_float8_tensor_it_would_keep(llama):
    weights = os.path.join(llama, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.up_proj\.weight is stored as torch\.float8_e4m3fn; dtype_policy='loaded' keeps .*"
        r"dtype_policy='declared'",
    ):
        load(llama, dtype_policy="loaded")
    # 'declared' casts it, as transformers does
    ours, theirs = load(llama), Auto.from_pretrained(llama)
    assert ours.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert torch.equal(ours.model.layers[0].mlp.up_proj.weight, theirs.model.layers[0].mlp.up_proj.weight)


def test_save_dtype_must_be_a_float_dtype(llama, tmp_path):
    model = load(llama)
    with pytest.raises(ValueError, match=r"^dtype=torch\.int8: transformers loads floating tensors only into"):
        lowmem_hf.save_pretrained(model, tmp_path / "out", dtype=torch.int8)
    assert not (tmp_path / "out").exists()


def test_a_key_mapping_that_is_not_a_regex_is_named():
    with pytest.raises(ValueError, match=r"key_mapping\['\('\] is not a regular expression: missing \).*re\.escape"):
        make_request(Auto, "x", key_mapping={"(": "x"})
    with pytest.raises(TypeError, match=r"key_mapping must be a dict of \{regex: replacement\}, got list"):
        make_request(Auto, "x", key_mapping=[("a", "b")])
    with pytest.raises(TypeError, match=r"key_mapping entries must be str regex -> str replacement, got 'a': 1"):
        make_request(Auto, "x", key_mapping={"a": 1})


@pytest.mark.parametrize("kwargs, shown", [
    (dict(device="bogus"), "device='bogus'"),
    (dict(device=True), "device=True"),
    (dict(device_map={"": "bogus"}), r"device_map=\{'': 'bogus'\}"),
])
def test_a_device_that_is_not_one_is_named(kwargs, shown):
    with pytest.raises(ValueError, match=rf"^{shown} is not a device; pass 'cpu'"):
        make_request(Auto, "x", **kwargs)


@pytest.mark.parametrize("kwargs, argument", [(dict(device="meta"), "device"), (dict(device_map="meta"), "device_map")])
def test_the_meta_device_is_refused_naming_the_argument(kwargs, argument):
    with pytest.raises(UnsupportedArgumentError, match=rf"^{argument}='meta' would give a model with no weights") as e:
        make_request(Auto, "x", **kwargs)
    assert e.value.argument == argument


def test_device_map_meta_under_the_switch_is_what_transformers_does(llama):
    """transformers builds a model with no weights for device_map='meta'; the switch hands the call to it."""
    with lowmem_hf.patch_transformers(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = Auto.from_pretrained(llama, device_map="meta")
    assert [w for w in caught if issubclass(w.category, FallbackWarning) and "'device_map'" in str(w.message)]
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not lowmem_hf.is_patched()


def test_config_must_be_a_config_or_a_path_not_a_hub_id():
    with pytest.raises(TypeError, match=r"^config must be a transformers config .*got int 5\."):
        make_request(Auto, "x", config=5)


@pytest.mark.parametrize("changes, cause, field", [
    (dict(num_attention_heads=0), "ZeroDivisionError", r"hidden_size=64; num_attention_heads=0"),
    (dict(vocab_size="abc"), "StrictDataclassFieldValidationError", r"vocab_size='abc'"),
    (dict(rope_parameters={"rope_type": "linear"}), "KeyError", r"rope_parameters=\{'rope_type': 'linear'\}"),
], ids=["zero-heads", "wrong-type", "rope-missing-key"])
def test_transformers_config_errors_name_the_file_and_the_field(llama, changes, cause, field):
    config_file = _edit_config(llama, **changes)
    for call in (lambda: load(llama), lambda: lowmem_hf.load.load(make_request(transformers.LlamaForCausalLM, str(llama)))):
        with pytest.raises(ValueError, match=rf"could not build a config from {config_file}: {cause}: .*\[field: {field}\]") as e:
            call()
        assert type(e.value.__cause__).__name__ == cause


def test_a_config_error_from_a_keyword_override_says_so(llama):
    with pytest.raises(ValueError, match=r"\[field: vocab_size='abc' \(the keyword argument\)\]"):
        load(llama, vocab_size="abc")


def test_a_config_file_passed_as_config_is_the_one_named(llama, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(os.path.join(llama, "config.json"), other / "config.json")
    config_file = _edit_config(other, num_attention_heads=0)
    with pytest.raises(ValueError, match=rf"could not build a config from {config_file}: ZeroDivisionError"):
        load(llama, config=str(other))
    with pytest.raises(ValueError, match=rf"could not build a config from {config_file}: ZeroDivisionError"):
        load(llama, config=config_file)


def test_a_folder_without_config_json_keeps_transformers_own_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^Unrecognized model in .*empty"):
        load(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------------------
# found by the property suite (tests/test_integrity_properties.py): raw upstream exceptions, each named here
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, cause, field", [
    (dict(rope_scaling={"rope_type": "nonsense"}), "KeyError", r"rope_scaling=\{'rope_type': 'nonsense'\}"),
    (dict(rope_parameters={"rope_type": "nonsense", "rope_theta": 10000.0}), "KeyError", r"rope_parameters=\{'rope_type': 'nonsense'"),
    (dict(num_key_value_heads=0), "ZeroDivisionError", r"num_attention_heads=4; num_key_value_heads=0"),
    (dict(hidden_size=-64), "RuntimeError", r"vocab_size=96; hidden_size=-64"),
], ids=["rope-type-nonsense", "rope-parameters-nonsense", "zero-kv-heads", "negative-width"])
def test_config_values_that_break_building_the_model_name_the_file_and_the_field(llama, changes, cause, field):
    # transformers' own from_pretrained raises the bare KeyError / ZeroDivisionError / RuntimeError from its model code
    config_file = _edit_config(llama, **changes)
    with pytest.raises((KeyError, ZeroDivisionError, RuntimeError)) as raw:
        Auto.from_pretrained(llama)
    assert type(raw.value).__name__ == cause
    with pytest.raises(ValueError, match=rf"transformers could not build LlamaForCausalLM from {config_file}: {cause}: .*\[field: {field}") as e:
        load(llama)
    assert type(e.value.__cause__).__name__ == cause


@pytest.mark.parametrize("field", ["num_hidden_layers", "intermediate_size"])
def test_a_config_size_off_by_orders_of_magnitude_is_refused_while_building_not_a_hang(llama, field):
    # unchecked, the build on meta runs until the property suite's 60 s limit kills it (num_hidden_layers=10**12: a
    # module per layer); transformers' own from_pretrained does the same, for hours
    import time

    config_file = _edit_config(llama, **{field: 10**12})
    started = time.perf_counter()
    with pytest.raises(lowmem_hf.OversizedModelError, match=rf"^{config_file} builds a model that already has [\d,]+ parameters, over "
                       rf"1000x the [\d,]+ elements the checkpoint {llama} stores: a size in the config is off \({field}=1000000000000: larger"):
        load(llama)
    assert time.perf_counter() - started < 60


def test_a_model_far_larger_than_its_small_checkpoint_still_loads(llama):
    # the bound is relative and has a floor: a few extra layers on a tiny checkpoint are transformers' business
    # (missing keys, initialized), not an oversized model
    _edit_config(llama, num_hidden_layers=12)
    model = load(llama)
    assert len(model.model.layers) == 12 and model.lowmem_report.missing_keys


def test_a_config_object_that_breaks_building_is_named_as_the_config_argument(llama):
    config = transformers.AutoConfig.from_pretrained(llama)
    config.num_key_value_heads = 0
    with pytest.raises(ValueError, match=r"could not build LlamaForCausalLM from the config passed as config=: ZeroDivisionError: .*"
                                         r"num_key_value_heads=0"):
        load(llama, config=config)


@pytest.mark.parametrize("content", [b"{", b"", b"\xff\xfe{}"], ids=["cut", "empty", "not-utf8"])
def test_a_config_json_that_is_not_json_names_the_file_and_the_decoder_error(llama, content):
    (llama / "config.json").write_bytes(content)
    with pytest.raises(lowmem_hf.CorruptCheckpointError, match=rf"^{llama / 'config.json'} is not a valid JSON file: (JSONDecodeError|UnicodeDecodeError): "):
        load(llama)


@pytest.mark.parametrize("value", [{"rope_type": "yarn"}, 5, ["model.safetensors"], ""], ids=repr)
def test_transformers_weights_that_is_not_a_file_name_is_named(llama, value):
    _edit_config(llama, transformers_weights=value)
    with pytest.raises(ValueError, match=r"^config.json's transformers_weights is .*: expected the name of a weight file"):
        load(llama)


@pytest.fixture
def float8_llama(llama):
    """The tiny Llama with every weight stored as float8_e4m3fn and no dtype in config.json (an fp8 export)."""
    weights = os.path.join(llama, "model.safetensors")
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    config = json.loads((llama / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (llama / "config.json").write_text(json.dumps(config))
    return llama


@pytest.mark.parametrize("kwargs", [dict(dtype="auto"), dict()], ids=["auto", "default"])
def test_dtype_auto_on_a_float8_checkpoint_is_named_where_transformers_fails_in_its_model_code(float8_llama, kwargs):
    with pytest.raises(TypeError, match="couldn't find storage object Float8_e4m3fnStorage"):
        Auto.from_pretrained(float8_llama, **kwargs)
    with pytest.raises(ValueError, match=r"^dtype='auto' chose torch.float8_e4m3fn, the stored dtype of the first floating tensor in "
                                         r".*model.safetensors \('.*'\): transformers builds models only in .*Pass dtype=torch.bfloat16"):
        load(float8_llama, **kwargs)
    _edit_config(float8_llama, dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"chose torch.float8_e4m3fn, the config's dtype \(.*config.json: dtype='float8_e4m3fn'\)"):
        load(float8_llama, **kwargs)


def test_a_declared_dtype_on_a_float8_checkpoint_casts_as_transformers_does(float8_llama):
    ours, theirs = load(float8_llama, dtype=torch.bfloat16), Auto.from_pretrained(float8_llama, dtype=torch.bfloat16)
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), name


@pytest.mark.parametrize("kwargs, shown", [
    (dict(device=0), "device=0 is cuda:0"),
    (dict(device="cuda"), "device='cuda' is cuda"),
    (dict(device_map={"": 0}), r"device_map=\{'': 0\} is cuda:0"),
])
def test_a_device_this_torch_build_lacks_is_named_before_the_load(kwargs, shown):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=rf"^{shown}, but this process has no cuda device"):
        make_request(Auto, "x", **kwargs)


def test_an_empty_variant_is_named_where_transformers_finds_no_file(llama):
    with pytest.raises(OSError, match=r"model\.\.safetensors"):
        Auto.from_pretrained(llama, variant="")
    with pytest.raises(ValueError, match=r"^variant='' names no variant"):
        load(llama, variant="")


def test_a_config_path_that_does_not_exist_is_named_not_looked_up_as_a_repo(llama):
    with pytest.raises(lowmem_hf.CheckpointNotFoundError, match=r"^config='/nonexistent/x' is neither a local folder or file nor a Hub repo id"):
        load(llama, config="/nonexistent/x")


@pytest.mark.parametrize("subfolder", ["x", "/"])
def test_a_subfolder_without_config_json_says_where_it_looked(llama, subfolder):
    # transformers' "Unrecognized model in <folder>" names neither the subfolder nor the file
    with pytest.raises(ValueError, match=rf"^Unrecognized model in .*There is no config.json in {os.path.abspath(os.path.join(llama, subfolder))} \(subfolder='{subfolder}'\)"):
        load(llama, subfolder=subfolder)


@pytest.mark.parametrize("value", [5, "generation_config.json", {"max_length": 5}], ids=repr)
def test_a_generation_config_that_is_not_one_is_named_before_the_load(llama, value):
    # transformers calls value.to_dict() after loading the weights: an AttributeError at the very end
    with pytest.raises(TypeError, match=r"^generation_config must be a transformers GenerationConfig, .*got "):
        load(llama, generation_config=value)
    from transformers import GenerationConfig

    assert load(llama, generation_config=GenerationConfig(max_length=7)).generation_config.max_length == 7
