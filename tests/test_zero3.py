"""DeepSpeed ZeRO-3: every rank reads only its own partition of each parameter, and the partitions, buffers and
a Trainer job's losses are bit-identical to transformers' own ZeRO-3 load; a DeepSpeed AutoTP job (stages 0-2) trains
bit-identically under the switch. Real DeepSpeed on CPU, 2 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
from safetensors import safe_open

from clients import require_client

require_client("deepspeed")

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]


# gloo's exit-time abort (client_harness._end_process_group has the cause). The scripts end their group in order,
# and still a DeepSpeed job can abort at exit this way in CI (seen on the newest stack): the plain run, without
# lowmem_hf, after training and after writing its results.
_GLOO_EXIT_ABORT = "terminate called without an active exception"


def _run(command: list[str], cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, env=_env(), cwd=cwd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and _GLOO_EXIT_ABORT in proc.stderr and "Signal 6 (SIGABRT)" in proc.stderr:
        # that abort, and only that, is run again once: plain and switched jobs alike, nothing of it is ours
        proc = subprocess.run(command, env=_env(), cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_each_rank_reads_only_its_partitions_and_holds_transformers_values(make_checkpoint, tmp_path):
    cases = [
        make_checkpoint("llama", "safetensors"),
        make_checkpoint("llama", "safetensors") + ":bf16",  # DeepSpeed's bf16: converted on the fly
        make_checkpoint("qwen2_tied", "sharded") + ":offload",  # tied embeddings; offload_param to CPU
        make_checkpoint("gpt2", "safetensors"),  # biases, legacy buffers in the checkpoint
        make_checkpoint("llama", "bin"),
        # a TP job's dcp.save (chunks along dim 0 and dim 1): each partition cut out of the chunks it spans
        make_checkpoint("llama", "sharded") + ":dcp-tp",
        make_checkpoint("qwen2_tied", "sharded") + ":dcp-tp:bf16",
        make_checkpoint("llama", "sharded") + ":seqcls",  # a missing head, initialized as transformers does
    ]
    _run(_torchrun(2, os.path.join(SCRIPTS, "zero3_partitions.py"), str(tmp_path / "found"), *cases), tmp_path)
    for rank in range(2):
        for found in json.loads((tmp_path / f"found.{rank}.json").read_text()):
            case = found["case"]
            assert found["differ"] == [] and found["tied_same"] and found["lowmem_partitioned"], (rank, found)
            # every checkpoint here is fp32: 4 bytes per element of this rank's partitions, plus headers and buffers
            budget = 1.02 * 4 * found["partition_elements"] + found["buffer_bytes"] + found["header_bytes"]
            assert found["bytes_read"] <= budget, (rank, case, found)
            assert found["bytes_read"] - found["header_bytes"] >= 4 * found["partition_elements"], (rank, case)
            assert found["missing_keys"] == (["score.weight"] if case.endswith(":seqcls") else []), (rank, case)
            if case.endswith(":bf16"):
                assert found["partition_dtype"] == "torch.bfloat16"


def test_partitions_come_from_the_hub_by_range_or_by_file(make_checkpoint, hub_server, tmp_path):
    # fetch="ranges" under a process group: the cooperative fetch of exactly the partitions' byte ranges
    cases = [make_checkpoint("llama", "sharded") + ":hub-ranges", make_checkpoint("qwen2_tied", "sharded") + ":hub-files:bf16"]
    for case in cases:
        path = case.split(":")[0]
        hub_server.add_repo(f"org/{os.path.basename(path)}", path)
    proc = subprocess.run(
        _torchrun(2, os.path.join(SCRIPTS, "zero3_partitions.py"), str(tmp_path / "found"), *cases),
        env=_env(ZERO3_HUB=hub_server.url), cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in range(2):
        found = json.loads((tmp_path / f"found.{rank}.json").read_text())
        assert [f["case"] for f in found] == ["llama-sharded-float32:hub-ranges", "qwen2_tied-sharded-float32:bf16+hub-files"]
        for f in found:
            assert f["differ"] == [] and f["tied_same"] and f["lowmem_partitioned"], (rank, f)


@pytest.mark.parametrize("case,offload", [("llama", False), ("qwen2_tied", True), ("gpt2", False)])
def test_a_zero3_trainer_job_trains_bit_identically_under_the_switch(make_checkpoint, tmp_path, case, offload):
    model = make_checkpoint(case, "sharded")
    script = [os.path.join(SCRIPTS, "zero3_trainer.py"), "--model", model, "--output-dir", "out"] + (["--offload"] if offload else [])
    runs = {}
    for what, prefix in (("plain", []), ("switched", ["-m", "lowmem_hf", "run"])):
        (tmp_path / what).mkdir()
        _run(_torchrun(2, *prefix, *script), tmp_path / what)
        runs[what] = {r: json.loads((tmp_path / what / "out" / f"zero3_train.{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):
        plain, switched = runs["plain"][rank], runs["switched"][rank]
        assert switched["lowmem_report"] and not plain["lowmem_report"]
        assert len(plain["losses"]) == 5 and switched["losses"] == plain["losses"]
        assert switched["partitions"] == plain["partitions"]  # the trained partitions, bit for bit


@pytest.mark.parametrize("case,stage", [("llama", 0), ("qwen2_tied", 1)])
def test_a_deepspeed_autotp_job_trains_bit_identically_under_the_switch(make_checkpoint, tmp_path, case, stage):
    # AutoTP at stages 0-2 (README, "DeepSpeed"): lowmem_hf loads the whole model, as transformers does, and
    # DeepSpeed's engine cuts each rank's slices out of it when it starts. Reading only the slices is not done.
    model = make_checkpoint(case, "sharded")
    script = [os.path.join(SCRIPTS, "autotp_train.py"), "--model", model, "--output-dir", ".", "--zero-stage", str(stage)]
    stored = 0
    for name in os.listdir(model):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model, name), "pt") as f:
                stored += sum(math.prod(f.get_slice(k).get_shape()) * 4 for k in f.keys())  # fp32: 4 bytes an element
    runs = {}
    for what, prefix in (("plain", []), ("switched", ["-m", "lowmem_hf", "run"])):
        (tmp_path / what).mkdir()
        _run(_torchrun(2, *prefix, *script), tmp_path / what)
        runs[what] = {r: json.loads((tmp_path / what / f"autotp_train.{r}.json").read_text()) for r in (0, 1)}
    for rank in (0, 1):
        plain, switched = runs["plain"][rank], runs["switched"][rank]
        assert switched["lowmem_report"] and not plain["lowmem_report"]
        assert len(plain["losses"]) == 4 and switched["losses"] == plain["losses"]
        assert switched["shapes"] == plain["shapes"] and switched["slices"] == plain["slices"]  # bit for bit
        assert plain["shapes"]["model.layers.0.self_attn.q_proj.weight"] == [32, 64]  # DeepSpeed did slice: 64 -> 32
        assert switched["bytes_read"] - switched["header_bytes"] == stored  # every tensor, whole, on every rank
    assert runs["plain"][0]["slices"] != runs["plain"][1]["slices"]  # each rank holds its own


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_in_one_rank(path: str, mode: str, tmp_path) -> dict:
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "zero3_load.py"), path, mode], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ZERO3_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[0].removeprefix("ZERO3_RESULT "))


def test_what_zero3_cannot_read_falls_back_once_and_the_direct_api_says_why(make_checkpoint, tmp_path):
    # legacy per-expert keys that transformers merges: a converted tensor has no byte range per partition
    result = _load_in_one_rank(make_checkpoint("mixtral", "safetensors"), "fallback", tmp_path)
    assert result["direct"] == "deepspeed"  # UnsupportedArgumentError naming it, never a wrong model
    assert len(result["fallbacks"]) == 1 and "converts" in result["fallbacks"][0]
    assert result["partitioned"] and not result["lowmem_report"]  # transformers' own ZeRO-3 model


def test_zero3_with_autotp_is_refused_naming_deepspeed(make_checkpoint, tmp_path):
    result = _load_in_one_rank(make_checkpoint("llama", "safetensors"), "autotp", tmp_path)
    assert result["direct"] == "deepspeed" and "autotp_size" in result["direct_message"]


def test_a_load_inside_zero_init_without_an_hf_deepspeed_config_is_an_error_not_a_wrong_model(make_checkpoint, tmp_path):
    # before: an unpartitioned model whose rotary inv_freq buffer was left uninitialized
    result = _load_in_one_rank(make_checkpoint("llama", "safetensors"), "bare-zero-init", tmp_path)
    assert "HfDeepSpeedConfig" in result["direct"] and "deepspeed.zero.Init" in result["direct"]


def test_a_zero3_load_of_which_nothing_fits_is_an_error_directly_and_transformers_under_the_switch(make_checkpoint, tmp_path):
    # the direct API refuses a model of which not one tensor was loaded, even with ignore_mismatched_sizes=True;
    # the switch does what transformers does, by handing the call to transformers
    result = _load_in_one_rank(make_checkpoint("llama", "safetensors"), "nothing", tmp_path)
    assert result["plain"] == "loaded"  # partition shapes are compared as DeepSpeed's ds_shape, not (0,)
    assert result["direct"].startswith("NothingToLoadError: Not one of the"), result
    assert result["switched"] == result["transformers"], result  # under ZeRO-3 transformers itself refuses it
    assert len(result["switched_fallbacks"]) == 1 and "loads none of the checkpoint's tensors" in result["switched_fallbacks"][0]

