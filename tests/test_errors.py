"""Bad input fails early with a message that names the file/key, what was expected, what was found, and the fix."""

import json
import os
import shutil
import threading

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import lowmem_hf
from lowmem_hf import CorruptCheckpointError, MissingShardError, ShapeMismatchError
from lowmem_hf.auto import AUTO_CLASSES

Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]


@pytest.fixture
def sharded_llama(make_checkpoint, tmp_path):
    """A private copy of the sharded Llama the test may damage."""
    dst = tmp_path / "llama"
    shutil.copytree(make_checkpoint("llama", "sharded"), dst)
    return dst


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_missing_shard_names_the_file_and_its_keys(sharded_llama):
    os.remove(sharded_llama / "model-00002-of-00003.safetensors")
    with pytest.raises(MissingShardError) as e:
        Causal.from_pretrained(sharded_llama)
    msg = str(e.value)
    assert "model-00002-of-00003.safetensors" in msg and "model.safetensors.index.json" in msg
    index = json.loads((sharded_llama / "model.safetensors.index.json").read_text())
    first_key = next(k for k, v in index["weight_map"].items() if v == "model-00002-of-00003.safetensors")
    assert first_key in msg


def test_shape_mismatch_names_both_shapes_and_the_fix(sharded_llama):
    config = json.loads((sharded_llama / "config.json").read_text())
    config["vocab_size"] = 100
    (sharded_llama / "config.json").write_text(json.dumps(config))
    fds = open_fds()
    with pytest.raises(ShapeMismatchError) as e:
        Causal.from_pretrained(sharded_llama)
    msg = str(e.value)
    assert "model.embed_tokens.weight: checkpoint [96, 64]" in msg and "model [100, 64]" in msg
    assert "ignore_mismatched_sizes=True" in msg
    assert open_fds() == fds


def test_ignore_mismatched_sizes_initializes_like_transformers(sharded_llama, caplog):
    torch.manual_seed(0)
    ref, ref_info = transformers.AutoModelForCausalLM.from_pretrained(
        sharded_llama, vocab_size=100, ignore_mismatched_sizes=True, output_loading_info=True
    )
    torch.manual_seed(0)
    got, report = Causal.from_pretrained(sharded_llama, vocab_size=100, ignore_mismatched_sizes=True, output_loading_info=True)
    assert report["mismatched_keys"] == set(ref_info["mismatched_keys"])
    assert {k for k, *_ in report["mismatched_keys"]} == {"model.embed_tokens.weight", "lm_head.weight"}
    [warning] = [r.getMessage() for r in caplog.records if r.name == "lowmem_hf"]
    assert "2 mismatched keys, newly initialized (lm_head.weight: checkpoint (96, 64), model (100, 64), " in warning
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


@pytest.mark.parametrize(
    "damage,expected",
    [
        (lambda raw: raw[: len(raw) - 100], "truncated"),  # data cut short
        (lambda raw: raw[:5], "too short"),  # not even the length prefix
        (lambda raw: raw[:8] + b"{not json" + raw[17:], "not valid JSON"),  # header garbage
        (lambda raw: (10**9).to_bytes(8, "little") + raw[8:], "header claims"),  # absurd header length
    ],
    ids=["data", "prefix", "json", "length"],
)
def test_corrupt_safetensors_names_the_file_and_loads_nothing(sharded_llama, damage, expected):
    shard = sharded_llama / "model-00003-of-00003.safetensors"
    shard.write_bytes(damage(shard.read_bytes()))
    fds = open_fds()
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(sharded_llama)
    assert str(shard) in str(e.value) and expected in str(e.value)
    assert open_fds() == fds


@pytest.mark.parametrize("cache", ["warm", "cold"])
def test_file_shrinking_during_the_load_is_an_error_not_garbage(sharded_llama, monkeypatch, cache):
    # The header promised the bytes; if the file shrinks after planning, the reader must notice, on the warm path
    # and on the cold one (more reader threads, read-ahead hints), without hanging or leaking a descriptor.
    from lowmem_hf import load as load_mod
    from lowmem_hf import stream as stream_mod
    from lowmem_hf.formats import safetensors as safetensors_mod

    if cache == "cold":  # what mincore says of files not in the page cache (the bytes are the same either way)
        monkeypatch.setattr(load_mod, "cached_fraction", lambda paths: 0.0)
    original = safetensors_mod.SafetensorsReader.jobs
    shard = sharded_llama / "model-00003-of-00003.safetensors"

    def shrink_then_plan(self, info, dst, spec=None):
        if info.file == str(shard) and shard.stat().st_size > 100:
            os.truncate(shard, 100)
        return original(self, info, dst, spec)

    monkeypatch.setattr(safetensors_mod.SafetensorsReader, "jobs", shrink_then_plan)
    streamed, real_stream = [], load_mod.stream

    def recording_stream(plan, **kwargs):
        streamed.append((kwargs["read_ahead_hints"], kwargs["workers"]))
        return real_stream(plan, **kwargs)

    monkeypatch.setattr(load_mod, "stream", recording_stream)
    fds, outcome = open_fds(), []

    def load():
        try:
            outcome.append(Causal.from_pretrained(sharded_llama, chunk_bytes=4096))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive(), "the load hung on a truncated file"
    assert len(outcome) == 1 and isinstance(outcome[0], CorruptCheckpointError), outcome
    # opened after it shrank (warm): refused before any read; opened before (cold: the read-ahead hint opens it):
    # the first read past its new end
    message = str(outcome[0])
    assert str(shard) in message and ("to 100 bytes, after its header was read" in message or "the file ended" in message)
    assert open_fds() == fds
    expected_path = (True, stream_mod.COLD_WORKERS) if cache == "cold" else (False, stream_mod.DEFAULT_WORKERS)
    assert streamed == [expected_path]  # (read-ahead hints, reader threads): the path the test names ran


def test_index_key_the_model_lacks_is_unexpected_like_transformers(sharded_llama):
    shard = sharded_llama / "model-00001-of-00003.safetensors"
    tensors = load_file(shard)
    tensors["model.layers.0.extra_scale"] = torch.ones(3)
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path = sharded_llama / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.layers.0.extra_scale"] = shard.name
    index_path.write_text(json.dumps(index))

    _, ref_info = transformers.AutoModelForCausalLM.from_pretrained(sharded_llama, output_loading_info=True)
    _, report = Causal.from_pretrained(sharded_llama, output_loading_info=True)
    assert report["unexpected_keys"] == {"model.layers.0.extra_scale"} == set(ref_info["unexpected_keys"])


def test_unknown_dtype_policy(make_checkpoint):
    with pytest.raises(ValueError, match=r"dtype_policy='loadd' is not a policy\. Did you mean 'loaded'\?"):
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), dtype_policy="loadd")


@pytest.mark.parametrize("value,hint", [("bfloat15", "Did you mean 'bfloat16'?"), ("float", None), ("fp8", None)])
def test_dtype_strings(make_checkpoint, value, hint):
    path = make_checkpoint("llama", "sharded")
    if value == "float":  # a real torch dtype name (float32), accepted as transformers does
        assert Causal.from_pretrained(path, torch_dtype=value).dtype == torch.float32
        return
    with pytest.raises(ValueError, match=rf"torch_dtype='{value}' is not a torch dtype") as e:
        Causal.from_pretrained(path, torch_dtype=value)
    if hint:
        assert hint in str(e.value)


def test_conflicting_dtype_aliases(make_checkpoint):
    with pytest.raises(ValueError, match="disagree"):
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), torch_dtype=torch.float16, dtype=torch.bfloat16)


@pytest.mark.parametrize("kwarg,closest", [("torch_dtyp", "torch_dtype"), ("num_label", "num_labels"), ("revison", "revision")])
def test_unknown_keyword_names_the_closest_valid_one(make_checkpoint, kwarg, closest):
    with pytest.raises(TypeError, match=rf"'{kwarg}' Did you mean '{closest}'\?"):
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), **{kwarg: 1})


def test_config_attribute_keywords_override_the_config(make_checkpoint):
    path = make_checkpoint("bert", "sharded")
    model = lowmem_hf.LowMemAutoModel.from_pretrained(path, output_attentions=True, hidden_dropout_prob=0.3)
    assert model.config.output_attentions is True and model.config.hidden_dropout_prob == 0.3


def test_model_init_keywords_reach_the_model(make_checkpoint):
    path = make_checkpoint("bert", "sharded")
    ref = transformers.AutoModel.from_pretrained(path, add_pooling_layer=False)
    got = lowmem_hf.LowMemAutoModel.from_pretrained(path, add_pooling_layer=False)
    assert got.pooler is None and ref.pooler is None


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"quantization_config": {}}, "quantization_config"),
        ({"gguf_file": "x.gguf"}, "gguf_file"),
        ({"device_map": "auto"}, "device_map='auto'"),
        ({"device_map": {"model": "cpu", "lm_head": "disk"}}, "device_map="),
        ({"distributed_config": {"pp_size": 2}}, "pp_size=2"),
        ({"distributed_config": {"ep_size": 2, "fsdp_size": 2}}, "ep_size=2"),
        ({"state_dict": {}}, "state_dict"),
    ],
)
def test_unsupported_transformers_arguments_are_named(make_checkpoint, kwargs, name):
    with pytest.raises(NotImplementedError, match=name.replace("(", r"\(")):
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), **kwargs)


@pytest.mark.parametrize("device_map", ["cpu", {"": "cpu"}, torch.device("cpu")])
def test_single_device_map_is_supported(make_checkpoint, device_map):
    model = Causal.from_pretrained(make_checkpoint("llama", "sharded"), device_map=device_map)
    assert model.lm_head.weight.device.type == "cpu"


def test_no_weights_in_folder(tmp_path, make_checkpoint):
    shutil.copy(os.path.join(make_checkpoint("llama", "sharded"), "config.json"), tmp_path)
    with pytest.raises(lowmem_hf.CheckpointNotFoundError, match="looked for model.safetensors"):
        Causal.from_pretrained(tmp_path)


def test_pickle_with_code_needs_weights_only_false(tmp_path, make_checkpoint):
    src = make_checkpoint("llama", "bin")
    dst = tmp_path / "llama"
    shutil.copytree(src, dst)
    shard = dst / "pytorch_model-00001-of-00003.bin"
    state = torch.load(shard, weights_only=True)
    torch.save({**state, "model.norm.extra": _Unsafe()}, shard)
    with pytest.raises(CorruptCheckpointError, match="weights_only=False"):
        Causal.from_pretrained(dst)


class _Unsafe:
    """An arbitrary object in a pickle: weights_only=True must refuse it."""


def test_a_path_that_is_neither_a_folder_nor_a_repo_id(tmp_path):
    with pytest.raises(lowmem_hf.CheckpointNotFoundError, match="neither a local folder nor a Hub repo id"):
        Causal.from_pretrained(str(tmp_path / "no" / "such" / "folder"))
