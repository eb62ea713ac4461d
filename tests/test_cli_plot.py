"""``lowmem-hf load --plot FILE`` draws host memory over the time of each load; without matplotlib it says which
extra to install before any load starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def _env(tmp_path, *first_on_path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (*first_on_path, REPO, env.get("PYTHONPATH")) if p))
    return env


def test_a_comparison_draws_both_loaders_memory_over_time_into_a_png(make_checkpoint, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    proc = subprocess.run(
        [sys.executable, "-m", "lowmem_hf", "load", make_checkpoint("llama", "sharded"), "--dtype", "bfloat16",
         "--compare-transformers", "--repeats", "1", "--plot", str(png), "--json"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["loader"] for r in out["loads"]] == ["lowmem", "transformers", "bare"]  # bare is measured, not drawn
    for run in out["loads"]:
        seconds = [s[0] for s in run["series"]]
        assert len(seconds) >= 2 and seconds == sorted(seconds)  # sampled from the start of the load to its end
        # the curves are the samples the headline peaks come from; the last is taken when the child says LOADED
        assert max(s[1] for s in run["series"]) == run["peak_rss_anon_bytes"]
        assert run["series"][-1][2] == run["peak_vm_hwm_bytes"]


def test_plot_without_matplotlib_names_the_extra_before_any_load(tmp_path):
    fake = tmp_path / "no_matplotlib"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    png = tmp_path / "memory.png"
    # a folder that does not exist: the error is about matplotlib, so no load was attempted
    proc = subprocess.run(
        [sys.executable, "-m", "lowmem_hf", "load", str(tmp_path / "no-such-model"), "--compare-transformers",
         "--plot", str(png)],
        env=_env(tmp_path, str(fake)), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "lowmem-hf: error: --plot needs matplotlib (No module named matplotlib): pip install 'lowmem_hf[plot]'"
    ]
    assert not png.exists()


def test_plan_imports_neither_the_measuring_harness_nor_matplotlib(make_checkpoint, tmp_path):
    code = (
        "import contextlib, io, json, sys\nfrom lowmem_hf import cli\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n    status = cli.main(['plan', {make_checkpoint('llama', 'sharded')!r}, '--json'])\n"
        "print(json.dumps([status, [m for m in ('lowmem_hf.measured_load', 'matplotlib') if m in sys.modules]]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [0, []]
