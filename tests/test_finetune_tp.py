"""examples/finetune_tp.py: Trainer fine-tuning of a tensor-parallel model (2 CPU ranks, gloo) matches one process.

Runs the example twice on a tiny Llama: ``--no-tp`` in one plain process (the reference), and under
``torchrun --nproc-per-node 2`` with ``tp_plan="auto"``. The per-step losses must agree, and the checkpoint
the TP run gathers and saves must give the same logits as the reference run's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import transformers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "finetune_tp.py")
STEPS = 5
TIMEOUT = 300  # seconds per subprocess; each run takes a few seconds on 2 cores
# Variables a surrounding launcher may have set; the reference run must be a plain single process.
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(launcher: list[str], args: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(
        OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
    )
    return subprocess.run(
        [*launcher, SCRIPT, *args], env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT
    )


def _check(proc: subprocess.CompletedProcess, what: str):
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _logits(path: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = (torch.arange(20).reshape(2, 10) * 7 + 3) % model.config.vocab_size
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("loader", ["transformers", "lowmem"])
def test_tp_finetune_matches_single_process(loader, tiny_llama, tmp_path):
    common = ["--model", tiny_llama, "--loader", loader, "--steps", str(STEPS), "--dtype", "float32"]
    tp_out, ref_out = tmp_path / "tp", tmp_path / "ref"

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(_free_port())]
    tp = _run(torchrun, [*common, "--output-dir", str(tp_out), "--allow-cpu-tp",
                         "--losses-out", str(tmp_path / "tp.json")], tmp_path)
    if loader == "lowmem" and tp.returncode != 0 and "NotImplementedError" in tp.stderr and "tp_plan" in tp.stderr:
        pytest.skip("lowmem_hf does not support tp_plan yet (from_pretrained raises NotImplementedError)")
    _check(tp, "torchrun (2-rank TP) run")

    ref = _run([sys.executable], [*common, "--output-dir", str(ref_out), "--no-tp",
                                  "--losses-out", str(tmp_path / "ref.json")], tmp_path)
    _check(ref, "single-process reference run")

    tp_losses = json.loads((tmp_path / "tp.json").read_text())
    ref_losses = json.loads((tmp_path / "ref.json").read_text())
    assert len(tp_losses) == len(ref_losses) == STEPS
    assert tp_losses == pytest.approx(ref_losses, abs=1e-5, rel=0), (tp_losses, ref_losses)

    # The TP run's save_model gathered full tensors: an ordinary checkpoint, loadable in one process.
    tp_logits, ref_logits, init_logits = _logits(str(tp_out)), _logits(str(ref_out)), _logits(tiny_llama)
    assert (ref_logits - init_logits).abs().max() > 1e-3, "training did not change the model"
    torch.testing.assert_close(tp_logits, ref_logits, atol=1e-5, rtol=0)
