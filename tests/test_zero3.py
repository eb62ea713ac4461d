"""DeepSpeed ZeRO-3: lowmem_hf does not load into ZeRO-3 partitions yet, so it never returns a wrong model there:
the direct API names the reason and the switch hands the call to transformers' own ZeRO-3 loader."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "zero3_load.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_under_zero3_the_switch_falls_back_once_and_the_direct_api_says_why(make_checkpoint, tmp_path):
    path = make_checkpoint("llama", "sharded")
    env = dict(
        os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
        LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
    )
    proc = subprocess.run([sys.executable, SCRIPT, path], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("ZERO3_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(lines[0].removeprefix("ZERO3_RESULT "))
    assert result["direct"] == "deepspeed"  # never a ShapeMismatchError against the partitioned skeleton
    assert len(result["fallbacks"]) == 1 and "'deepspeed'" in result["fallbacks"][0]
    assert result["partitioned"] and not result["lowmem_report"]  # transformers' own ZeRO-3 model
