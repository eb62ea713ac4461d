"""The one-line switch: transformers' own from_pretrained calls go through lowmem_hf, and back when undone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedModel
from transformers.models.auto.auto_factory import _BaseAutoModelClass

import lowmem_hf
from lowmem_hf.patch import FallbackWarning
from test_equivalence import assert_same_model, assert_same_tying

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "finetune_plain.py")
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _always_unpatched():
    yield
    lowmem_hf.unpatch_transformers()


class MyLlama(LlamaForCausalLM):
    """A subclass a user wrote: the switch must return exactly this class."""


def _originals():
    return [cls.__dict__["from_pretrained"] for cls in (_BaseAutoModelClass, AutoModelForCausalLM, PreTrainedModel)]


def test_auto_class_call_is_loaded_by_lowmem_and_bit_identical(make_checkpoint):
    path = make_checkpoint("qwen2_tied", "sharded")
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with lowmem_hf.patch_transformers():
        torch.manual_seed(0)
        got = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert got.lowmem_report.bytes_read > 0  # lowmem_hf loaded it (transformers' models have no report)
    assert not hasattr(ref, "lowmem_report")
    assert_same_model(ref, got)
    assert_same_tying(ref, got)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, MyLlama], ids=["concrete", "user_subclass"])
def test_concrete_class_call_returns_that_class(make_checkpoint, cls):
    path = make_checkpoint("llama", "safetensors")
    ref = cls.from_pretrained(path)
    with lowmem_hf.patch_transformers():
        got = cls.from_pretrained(path)
    assert type(got) is cls and hasattr(got, "lowmem_report")
    assert_same_model(ref, got)


def test_output_loading_info_keeps_transformers_contract(make_checkpoint):
    path = make_checkpoint("llama", "safetensors")
    _, ref_info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    with lowmem_hf.patch_transformers():
        _, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info == ref_info and type(info) is dict


@pytest.mark.parametrize(
    "kwargs,argument",
    [({"device_map": "auto"}, "device_map"), ({"offload_folder": "/tmp/x"}, "offload_folder")],
)
def test_unsupported_argument_falls_back_with_exactly_one_warning(make_checkpoint, kwargs, argument):
    path = make_checkpoint("llama", "safetensors")
    with lowmem_hf.patch_transformers():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    ours = [w for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert repr(argument) in str(ours[0].message)
    assert not hasattr(model, "lowmem_report")  # transformers loaded it


def test_quantized_checkpoint_falls_back_to_transformers(make_checkpoint, tmp_path):
    # a config that declares quantization: lowmem_hf must not load it as if it were plain floats
    from lowmem_hf.errors import UnsupportedArgumentError
    from lowmem_hf.routing import reject_quantized as _reject_quantized

    config = transformers.LlamaConfig()
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(UnsupportedArgumentError, match="quant_method='bitsandbytes'") as raised:
        _reject_quantized(config)
    assert raised.value.argument == "quantization_config"


def test_context_manager_and_unpatch_restore_the_original_methods():
    before = _originals()
    with lowmem_hf.patch_transformers():
        assert lowmem_hf.is_patched() and _originals() != before
    assert _originals() == before and not lowmem_hf.is_patched()
    lowmem_hf.patch_transformers()
    lowmem_hf.patch_transformers()  # idempotent: unpatching once restores
    lowmem_hf.unpatch_transformers()
    assert _originals() == before
    assert all(a is b for a, b in zip(_originals(), before))


def test_errors_of_a_real_load_are_not_hidden_by_a_fallback(tmp_path):
    with lowmem_hf.patch_transformers(), pytest.raises(OSError, match="does_not_exist"):
        AutoModelForCausalLM.from_pretrained(str(tmp_path / "does_not_exist"))


# ---- unchanged scripts: `python -m lowmem_hf run` and torchrun -----------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("switch_llama"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(launcher: list[str], args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(
        OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
    )
    proc = subprocess.run([*launcher, *args], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{launcher} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _losses(tmp_path, name):
    with open(tmp_path / name) as f:
        return json.load(f)


def test_unchanged_script_runs_under_the_switch_with_equal_losses(tiny_llama, tmp_path):
    common = [SCRIPT, "--model", tiny_llama, "--steps", "3"]
    plain = _run([sys.executable], [*common, "--output-dir", "plain", "--losses-out", "plain.json"], tmp_path)
    switched = _run(
        [sys.executable, "-m", "lowmem_hf", "run"], [*common, "--output-dir", "sw", "--losses-out", "sw.json"], tmp_path
    )
    assert "[lowmem_hf] lowmem_hf loaded LlamaForCausalLM" in switched.stderr
    assert "lowmem_hf loaded" not in plain.stderr
    assert "__main__ ok" in switched.stdout  # the script ran as __main__ with its own argv
    assert _losses(tmp_path, "sw.json") == _losses(tmp_path, "plain.json")


def test_unchanged_script_under_torchrun_tp_matches_without_the_switch(tiny_llama, tmp_path):
    def torchrun():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port())]

    common = ["--model", tiny_llama, "--steps", "3", "--tp", "--allow-cpu-tp"]
    _run(torchrun(), [SCRIPT, *common, "--output-dir", "plain", "--losses-out", "plain.json"], tmp_path)
    switched = _run(
        torchrun(), ["-m", "lowmem_hf", "run", SCRIPT, *common, "--output-dir", "sw", "--losses-out", "sw.json"], tmp_path
    )
    assert switched.stderr.count("lowmem_hf loaded LlamaForCausalLM") == 1  # rank 0 only
    plain, ours = _losses(tmp_path, "plain.json"), _losses(tmp_path, "sw.json")
    assert len(ours) == len(plain) == 3
    assert ours == pytest.approx(plain, abs=1e-6)  # TP reductions: same arithmetic, same order


def test_run_of_a_missing_script_is_a_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lowmem_hf", "run", str(tmp_path / "nope.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "nope.py" in proc.stderr and "Traceback" not in proc.stderr
