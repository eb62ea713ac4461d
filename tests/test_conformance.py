"""lowmem_hf serves what users already pass transformers: off-valued arguments, the ambient device, variant names,
converter errors, HF_DEACTIVATE_ASYNC_LOAD and config-less DCP directories, each exactly as transformers does."""

from __future__ import annotations

import json
import os
import shutil
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GenerationConfig

import lowmem_hf
from lowmem_hf.patch import FallbackWarning
from lowmem_hf.arguments import transformers_defaults
from clients import require_client
from test_equivalence import assert_same_model


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    lowmem_hf.unpatch_transformers()


def _switched(call):
    """``call()`` under the switch, with every FallbackWarning an error: lowmem_hf must serve it."""
    with lowmem_hf.patch_transformers(), warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        torch.manual_seed(0)
        return call()


# transformers' own examples (run_clm.py, run_mlm.py) and TRL pass these at their defaults on every ordinary load
OFF_VALUED = dict(
    from_tf=False, from_flax=False, quantization_config=None, use_kernels=False, offload_folder=None,
    offload_state_dict=False, offload_buffers=False, max_memory=None, adapter_kwargs=None, adapter_name=None,
    state_dict=None, gguf_file=None, low_cpu_mem_usage=True, trust_remote_code=False, revision="main", token=None,
)


def test_off_valued_arguments_are_served_by_lowmem_hf(make_checkpoint):
    path = make_checkpoint("llama", "sharded")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **OFF_VALUED)
    got = _switched(lambda: AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **OFF_VALUED))
    assert hasattr(got, "lowmem_report")
    assert_same_model(ref, got)


def test_run_clm_passes_from_tf_as_a_path_test_and_is_served(make_checkpoint):
    path = make_checkpoint("gpt2", "safetensors")
    config = transformers.AutoConfig.from_pretrained(path)
    got = _switched(lambda: AutoModelForCausalLM.from_pretrained(path, from_tf=bool(".ckpt" in path), config=config))
    assert hasattr(got, "lowmem_report")


def test_a_real_fallback_warns_once_naming_the_argument_and_its_value(make_checkpoint):
    path = make_checkpoint("llama", "safetensors")
    with lowmem_hf.patch_transformers(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = AutoModelForCausalLM.from_pretrained(path, offload_buffers=True)
    fallbacks = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(fallbacks) == 1 and "offload_buffers=True" in str(fallbacks[0].message)
    assert not hasattr(got, "lowmem_report")


def test_a_non_default_value_is_refused_by_the_direct_api():
    with pytest.raises(lowmem_hf.UnsupportedArgumentError, match=r"adapter_kwargs=\{'revision': 'x'\}"):
        lowmem_hf.make_request(AutoModelForCausalLM, "org/model", adapter_kwargs={"revision": "x"})
    with pytest.raises(lowmem_hf.UnsupportedArgumentError, match=r"use_kernels=1"):
        lowmem_hf.make_request(AutoModelForCausalLM, "org/model", use_kernels=1)  # 1 is not transformers' False


def test_defaults_are_read_from_transformers_own_from_pretrained():
    known = transformers_defaults()
    assert {"from_tf", "from_flax", "offload_state_dict", "low_cpu_mem_usage"} <= known.ignored
    assert known.defaults["offload_buffers"] is False and known.defaults["quantization_config"] is None
    assert known.defaults["adapter_name"] == "default" and "adapter_kwargs" in known.falsy_is_default


def test_a_folder_holding_a_peft_adapter_is_handed_to_transformers(make_checkpoint, tmp_path):
    peft = require_client("peft")
    base = make_checkpoint("llama", "safetensors")
    folder = tmp_path / "with-adapter"
    shutil.copytree(base, folder)
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(folder)  # adapter_config.json next to a complete model: transformers attaches it
    ref = AutoModelForCausalLM.from_pretrained(folder)
    with lowmem_hf.patch_transformers(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = AutoModelForCausalLM.from_pretrained(folder)
    assert [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)][0].count("adapter") >= 1
    assert_same_model(ref, got, same_source=False)


@pytest.mark.parametrize("case_name", ["llama", "gpt2"])
@pytest.mark.parametrize("how", ["context", "default_device"])
def test_meta_as_ambient_device_raises_transformers_error(make_checkpoint, case_name, how):
    path = make_checkpoint(case_name, "safetensors")

    def under_meta(call):
        try:
            if how == "context":
                with torch.device("meta"):
                    call()
            else:
                torch.set_default_device("meta")
                call()
        except Exception as error:  # noqa: BLE001 - compared below
            return error
        finally:
            torch.set_default_device(None)
        raise AssertionError("loaded under a meta device")

    theirs = under_meta(lambda: AutoModelForCausalLM.from_pretrained(path))
    ours = under_meta(lambda: lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path))
    assert type(ours) is type(theirs) is RuntimeError
    assert str(ours) == str(theirs) and "meta device context manager" in str(ours)


def test_the_ambient_device_is_the_load_device(make_checkpoint):
    path = make_checkpoint("llama", "safetensors")
    device = "cuda"  # transformers loads onto it where there is one; on a CPU-only build both loaders must fail alike

    def under(call):
        try:
            with torch.device(device):
                return call(), None
        except Exception as error:  # noqa: BLE001 - on a CPU-only build both loaders must fail the same way
            return None, error

    ref, theirs = under(lambda: AutoModelForCausalLM.from_pretrained(path))
    got, ours = under(lambda: lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path))
    if theirs is not None:
        assert ours is not None, "lowmem_hf ignored the ambient device"
        assert (type(ours), str(ours)) == (type(theirs), str(theirs))
    else:
        assert next(got.parameters()).device == next(ref.parameters()).device
    # the request itself is decided under the context (on a CPU-only build the loads above could fail alike for
    # another reason: any allocation under a cuda context fails)
    try:
        with torch.device(device):
            decided = lowmem_hf.make_request(AutoModelForCausalLM, path).device
    except Exception as error:  # noqa: BLE001 - compared with transformers' error
        assert theirs is not None and (type(error), str(error)) == (type(theirs), str(theirs))
    else:
        assert decided.type == "cuda", f"the request chose {decided} under a cuda device context"
    with torch.device("cpu"):
        assert next(lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path).parameters()).device.type == "cpu"


def _bin_variant(folder, variant: str) -> None:
    """Rewrite a safetensors save as two ``.bin`` shards with a variant index, named as transformers names them."""
    tensors = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
            os.remove(os.path.join(folder, name))
    for name in os.listdir(folder):
        if name.endswith(".json") and "index" in name:
            os.remove(os.path.join(folder, name))
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :])):
        shard = f"pytorch_model-{i + 1:05d}-of-00002.{variant}.bin"
        torch.save({k: tensors[k] for k in part}, os.path.join(folder, shard))
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(folder, f"pytorch_model.bin.index.{variant}.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("layout", ["single", "sharded", "bin_sharded"])
def test_variants_are_named_as_transformers_names_them(tmp_path, layout):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    ))
    folder = tmp_path / layout
    model.save_pretrained(folder, variant="v2", max_shard_size="100KB" if layout != "single" else "5GB")
    if layout == "bin_sharded":
        _bin_variant(folder, "v2")
    files = sorted(os.listdir(folder))
    expected = {"single": "model.v2.safetensors", "sharded": "model.safetensors.index.v2.json",
                "bin_sharded": "pytorch_model.bin.index.v2.json"}[layout]
    assert expected in files, files
    ref = AutoModelForCausalLM.from_pretrained(folder, variant="v2")
    got = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(folder, variant="v2")
    assert_same_model(ref, got)


@pytest.mark.parametrize("fetch", ["files", "ranges"])
def test_a_sharded_variant_loads_from_the_hub(hf_hub, tmp_path, fetch):
    folder = tmp_path / "sharded-variant"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )).save_pretrained(folder, variant="v2", max_shard_size="100KB")
    hf_hub.add_repo("org/variant", folder)
    ref = AutoModelForCausalLM.from_pretrained(folder, variant="v2")
    got = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained("org/variant", variant="v2", fetch=fetch)
    assert_same_model(ref, got, same_source=False)
    assert any(r.filename == "model.safetensors.index.v2.json" for r in hf_hub.requests)


def test_a_failing_converter_raises_transformers_error_with_its_cause(make_checkpoint, tmp_path):
    folder = tmp_path / "mixtral"
    shutil.copytree(make_checkpoint("mixtral", "safetensors"), folder)
    tensors = load_file(folder / "model.safetensors")
    (key,) = [k for k in tensors if k.endswith("layers.0.block_sparse_moe.experts.1.w1.weight")]
    tensors[key] = tensors[key][:, :-1].contiguous()  # one expert narrower: stacking the experts fails
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError) as theirs:
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(RuntimeError) as ours:
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(folder)
    first_sentence = "We encountered some issues during automatic conversion of the weights."
    assert str(theirs.value).startswith(first_sentence) and str(ours.value).startswith(first_sentence)
    assert "gate_up_proj" in str(ours.value)
    assert isinstance(ours.value.__cause__, RuntimeError) and "stack expects" in str(ours.value.__cause__)


@pytest.mark.parametrize("deactivated", [False, True])
def test_hf_deactivate_async_load_starts_no_thread(make_checkpoint, monkeypatch, deactivated):
    path = make_checkpoint("llama", "sharded")
    lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)  # warm the page cache: workers = cores
    if deactivated:
        monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    started = []
    start = threading.Thread.start

    def recording_start(thread):
        started.append(thread.name)
        return start(thread)

    monkeypatch.setattr(threading.Thread, "start", recording_start)
    transformers.logging.disable_progress_bar()  # tqdm's monitor thread is the bar's, not the load's
    try:
        ref = AutoModelForCausalLM.from_pretrained(path)
        started_by_transformers = list(started)
        started.clear()
        got = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)
    finally:
        transformers.logging.enable_progress_bar()
    assert_same_model(ref, got)
    if deactivated:
        assert started == [] and started_by_transformers == []
        assert got.lowmem_report.reader_workers == 1
    else:
        assert started and got.lowmem_report.reader_workers > 1


@pytest.fixture
def configless_dcp(tmp_path):
    """A ``dcp.save(model.state_dict())`` directory (``.metadata`` + ``*.distcp`` only) and the config's folder."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM(config)
    config_folder = tmp_path / "config"
    model.config.save_pretrained(config_folder)
    GenerationConfig(max_length=7, do_sample=False, bos_token_id=1).save_pretrained(config_folder)
    checkpoint = tmp_path / "dcp"
    dcp.save(model.state_dict(), checkpoint_id=checkpoint, no_dist=True)
    names = sorted(p.name for p in checkpoint.iterdir())
    assert names[0] == ".metadata" and all(n.endswith(".distcp") for n in names[1:]), names
    return model, checkpoint, config_folder


@pytest.mark.parametrize("given", ["folder", "file", "object"])
def test_a_configless_dcp_directory_loads_with_config_given(configless_dcp, given):
    model, checkpoint, config_folder = configless_dcp
    config = {
        "folder": str(config_folder),
        "file": str(config_folder / "config.json"),
        "object": transformers.AutoConfig.from_pretrained(config_folder),
    }[given]
    got = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(checkpoint, config=config)
    for name, tensor in model.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name
    if given == "object":  # built from the config, as transformers builds it when no file has one
        expected = GenerationConfig.from_model_config(config)
    else:  # the config's folder has one
        expected = GenerationConfig.from_pretrained(config_folder)
    assert got.generation_config.to_dict() == expected.to_dict()
    assert (got.generation_config.max_length == 7) is (given != "object")


def test_a_checkpoint_none_of_whose_tensors_loads_is_an_error_whatever_ignore_mismatched_sizes(make_checkpoint):
    llama = make_checkpoint("llama", "safetensors")
    with pytest.raises(lowmem_hf.NothingToLoadError, match=r"Not one of the \d+ tensors .* have another shape"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(llama, hidden_size=128, ignore_mismatched_sizes=True)
    bert = make_checkpoint("bert", "safetensors")
    with pytest.raises(lowmem_hf.NothingToLoadError, match=r"match no parameter"):  # transformers: a random model
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(bert, config=llama)
