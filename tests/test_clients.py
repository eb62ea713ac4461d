"""Real client code under the switch: run_clm, TRL's SFTTrainer, PEFT and pipelines, unchanged.

Each script in ``tests/scripts`` is written the way its library's authors write scripts and knows nothing of
lowmem_hf. Every test runs it twice, as ``python script.py`` and as ``python -m lowmem_hf run script.py`` (or
both under ``torchrun``), and checks that under the switch (a) lowmem_hf served every ``from_pretrained`` the
client made, with no ``FallbackWarning``, and (b) the results are bit-identical to the plain run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import transformers

from clients import require_client

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
RESULT_PREFIX = "CLIENT_RESULT "  # client_harness.RESULT_PREFIX
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
_TIMEOUT_S = 300

# The tokenizer's words: a few real ones for readable prompts, then filler up to the model's vocabulary.
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
_WORDS = (
    "the a cat dog bird fox sat ran flew jumps on under over near mat rug tree house big small red blue quick "
    "lazy old young and then sun moon sings sleeps"
).split()
VOCAB_SIZE = 128


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> str:
    """A tiny Llama and its word-level tokenizer in one folder, as a client finds a Hub model (sharded safetensors)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = _WORDS + [f"w{i:03d}" for i in range(VOCAB_SIZE - len(_SPECIALS) - len(_WORDS))]
    vocab = {token: i for i, token in enumerate(_SPECIALS + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"],
    )
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("client_llama"))
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="40KB")
    tokenizer.save_pretrained(path)
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # sharded, as Hub models are
    return path


# ---- running a script with and without the switch -------------------------------------------------------


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(
        OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
    )
    return env


def _launchers(nproc: int) -> tuple[list[str], list[str]]:
    """(plain, switched) command prefixes; the script path and its arguments follow."""
    if nproc == 1:
        return [sys.executable], [sys.executable, "-m", "lowmem_hf", "run"]
    # --standalone: a rendezvous on a free local port, chosen by torchrun itself
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return torchrun, [*torchrun, "-m", "lowmem_hf", "run"]


def _results(proc: subprocess.CompletedProcess, what: str, nproc: int) -> dict[int, dict]:
    lines = [line[len(RESULT_PREFIX):] for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    by_rank = {r["rank"]: r for r in map(json.loads, lines)}
    assert proc.returncode == 0 and sorted(by_rank) == list(range(nproc)), (
        f"{what} run failed (exit {proc.returncode}, results from ranks {sorted(by_rank)}):\n"
        f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return by_rank


def run_both(
    script: str, args: list[str], tmp_path, *, nproc: int = 1, hub=None
) -> tuple[dict[int, dict], dict[int, dict], str]:
    """Run ``script`` plainly and under the switch, side by side, each in its own folder under ``tmp_path``
    (``hub``: a ``HubServer`` the runs talk to, each with its own empty HF cache).

    Returns:
        (plain results by rank, switched results by rank, the switched run's output: stdout then stderr; where
        the log lines go depends on the script's logging setup).
    """
    plain_cmd, switched_cmd = _launchers(nproc)
    procs = {}
    for what, launcher in (("plain", plain_cmd), ("switched", switched_cmd)):
        cwd = tmp_path / what
        cwd.mkdir()
        with open(cwd / "stdout.txt", "w") as stdout, open(cwd / "stderr.txt", "w") as stderr:
            procs[what] = subprocess.Popen(
                [*launcher, os.path.join(SCRIPTS, script), *args], cwd=str(cwd),
                env=_env(cwd) if hub is None else hub.subprocess_env(cwd / "hf_home", base=_env(cwd)),
                stdout=stdout, stderr=stderr, start_new_session=True,  # a session: a timeout ends torchrun's ranks too
            )
    done = {}
    try:
        for what, proc in procs.items():
            proc.wait(timeout=_TIMEOUT_S)
            out = {name: (tmp_path / what / f"{name}.txt").read_text() for name in ("stdout", "stderr")}
            done[what] = subprocess.CompletedProcess(proc.args, proc.returncode, out["stdout"], out["stderr"])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    plain = _results(done["plain"], "plain", nproc)
    switched = _results(done["switched"], "switched", nproc)
    return plain, switched, done["switched"].stdout + done["switched"].stderr


def assert_lowmem_served_every_load(plain: dict, switched: dict, output: str, loads: int) -> None:
    """Every from_pretrained under the switch went through lowmem_hf (and none in the plain run)."""
    for rank, result in switched.items():
        assert result["switched"] and not plain[rank]["switched"]
        assert result["fallbacks"] == [], f"rank {rank} fell back to transformers: {result['fallbacks']}"
        assert len(result["loads"]) == loads, result["loads"]
        assert all(load["lowmem_report"] for load in result["loads"]), f"rank {rank}: {result['loads']}"
        assert len(plain[rank]["loads"]) == loads and not any(load["lowmem_report"] for load in plain[rank]["loads"])
    assert "FallbackWarning" not in output
    assert output.count("lowmem_hf loaded LlamaForCausalLM") == loads  # one log line per load, from rank 0


def assert_same_results(plain: dict, switched: dict, keys: tuple[str, ...]) -> None:
    for rank in plain:
        for key in keys:
            assert switched[rank][key] == plain[rank][key], f"rank {rank}: {key} differs under the switch"


# ---- the clients ---------------------------------------------------------------------------------------


def _run_clm_args(model: str, *extra: str) -> list[str]:
    return [
        "--model_name_or_path", model, "--output_dir", "out", "--do_train", "--max_steps", "5",
        "--per_device_train_batch_size", "2", "--learning_rate", "1e-3", "--logging_steps", "1", "--seed", "0",
        "--block_size", "16", "--save_strategy", "no", "--report_to", "none", "--use_cpu", *extra,
    ]


def test_run_clm_trains_bit_identically_under_the_switch(tiny_lm, tmp_path):
    require_client("datasets")
    plain, switched, output = run_both("run_clm_like.py", _run_clm_args(tiny_lm), tmp_path)
    assert_lowmem_served_every_load(plain, switched, output, loads=1)
    assert len(plain[0]["losses"]) == 5
    assert_same_results(plain, switched, ("losses", "grad_norms", "trained_weights"))


def test_run_clm_under_torchrun_ddp_trains_bit_identically_under_the_switch(tiny_lm, tmp_path):
    require_client("datasets")
    args = _run_clm_args(tiny_lm, "--ddp_backend", "gloo", "--dtype", "bfloat16")
    plain, switched, output = run_both("run_clm_like.py", args, tmp_path, nproc=2)
    assert_lowmem_served_every_load(plain, switched, output, loads=1)
    assert plain[0]["world_size"] == 2 and len(plain[0]["losses"]) == 5
    assert plain[0]["trained_weights"] == plain[1]["trained_weights"]  # DDP kept the replicas equal
    assert_same_results(plain, switched, ("losses", "grad_norms", "trained_weights"))


def test_run_clm_under_torchrun_from_the_hub_trains_bit_identically_under_the_switch(tiny_lm, hub_server, tmp_path):
    require_client("datasets")
    # run_clm's `revision="main"` from a Hub repo: under the switch every rank pins the same commit (rank 0's)
    commit = hub_server.add_repo("org/tiny", tiny_lm)
    hub_server.reset_counters()
    args = _run_clm_args("org/tiny", "--ddp_backend", "gloo", "--dtype", "bfloat16")
    plain, switched, output = run_both("run_clm_like.py", args, tmp_path, nproc=2, hub=hub_server)
    assert_lowmem_served_every_load(plain, switched, output, loads=1)
    assert plain[0]["world_size"] == 2 and len(plain[0]["losses"]) == 5
    assert_same_results(plain, switched, ("losses", "grad_norms", "trained_weights"))
    weights = [r for r in hub_server.requests if r.filename and r.filename.endswith(".safetensors")]
    assert weights and all(r.commit == commit for r in weights)


def test_trl_sft_trainer_loading_from_a_path_trains_bit_identically(tiny_lm, tmp_path):
    require_client("trl")
    plain, switched, output = run_both("sft_trl.py", ["--model", tiny_lm, "--output-dir", "out"], tmp_path)
    assert_lowmem_served_every_load(plain, switched, output, loads=1)
    assert len(plain[0]["losses"]) == 4
    assert_same_results(plain, switched, ("losses", "grad_norms", "trained_weights"))


def test_peft_lora_trains_saves_and_reloads_bit_identically(tiny_lm, tmp_path):
    require_client("peft")
    plain, switched, output = run_both("peft_lora.py", ["--base", tiny_lm, "--adapter-dir", "adapter"], tmp_path)
    # the base for training, AutoPeftModelForCausalLM's base, and the base handed to PeftModel.from_pretrained
    assert_lowmem_served_every_load(plain, switched, output, loads=3)
    reloaded = plain[0]["reloaded_logits"]
    assert reloaded["auto_peft"] == reloaded["peft_model"] == plain[0]["trained_logits"]  # the adapter round-trips
    assert_same_results(plain, switched, ("losses", "adapter_weights", "trained_logits", "reloaded_logits"))


def test_text_generation_pipeline_generates_the_same_tokens(tiny_lm, tmp_path):
    plain, switched, output = run_both("pipeline_generate.py", ["--model", tiny_lm], tmp_path)
    assert_lowmem_served_every_load(plain, switched, output, loads=1)
    assert [len(ids) for ids in plain[0]["generate_token_ids"]] == [4 + 8, 4 + 8]  # prompt + max_new_tokens
    assert_same_results(plain, switched, ("pipeline_token_ids", "pipeline_texts", "generate_token_ids", "logits"))
