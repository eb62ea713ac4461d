"""``benchmarks/gpu_check.py`` is the one command the GPU machine runs; its CPU mode runs here so that it cannot rot."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_gpu_check():
    """The script as a module, by its path: benchmarks/ stays off sys.path, where its checkpoints.py would shadow
    the tests' own for every test that imports ``checkpoints`` after this one."""
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(REPO, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def test_gpu_check_on_the_cpu_prints_one_table_of_equal_loads(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--device", "cpu", "--small",
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| case | loader | cache | to usable |")
    rows = [line.split(" | ") for line in table[2:]]
    loaders = {(r[0].lstrip("| "), r[1]) for r in rows}
    for case in ("fp32 -> bf16", "bf16 -> bf16"):
        assert {(case, "lowmem"), (case, "transformers"), (case, "safetensors")} <= loaders
    assert {("fp32 -> bf16", "lowmem-map"), ("fp32 -> bf16", "lowmem-ambient")} <= loaders
    for case in ("tp2 fp32 -> bf16", "tp2 bf16 -> bf16"):  # two gloo ranks, each hashed against transformers' rank
        assert {(case, "lowmem"), (case, "transformers")} <= loaders
    assert all(r[-1].rstrip(" |") in ("equal", "reference") for r in rows), table
    assert "INEQUALITY" not in proc.stdout


def test_a_changed_tensor_is_an_inequality_that_names_it():
    reference = {"digest": {"a": "1", "b": "2", "c": "3"}}
    assert gpu_check.compare({"digest": {"a": "1", "b": "2", "c": "3"}}, reference) == "equal"
    verdict = gpu_check.compare({"digest": {"a": "1", "b": "9", "d": "4"}}, reference)
    assert verdict == "1 missing (e.g. c); 1 not in transformers' (e.g. d); 1 differ (e.g. b)"


def test_a_load_onto_other_devices_is_an_inequality_even_with_equal_bytes():
    reference = {"digest": {"a": "1"}, "devices": ["cuda:1"]}
    assert gpu_check.compare({"digest": {"a": "1"}, "devices": ["cuda:1"]}, reference) == "equal"
    verdict = gpu_check.compare({"digest": {"a": "1"}, "devices": ["cpu"]}, reference)
    assert verdict == "on ['cpu'], transformers' on ['cuda:1']"


def test_safetensors_is_compared_on_the_checkpoints_tensors_only():
    reference = {"digest": {"w": "1", "rotary.inv_freq": "2"}}
    assert gpu_check.compare_weights({"digest": {"w": "1"}}, reference) == "equal"
    assert gpu_check.compare_weights({"digest": {"w": "5"}}, reference) == "1 differ (e.g. w)"


def test_carried_wheels_are_unpacked_once_into_the_folder_put_first_on_the_path(tmp_path):
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("carried/__init__.py", "VERSION = '1.0'\n")
        wheel.writestr("carried-1.0.dist-info/METADATA", "Name: carried\nVersion: 1.0\n")
    site = gpu_check.install_wheels(wheels, tmp_path / "work")
    assert (site / "carried" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    assert (site / "carried-1.0.dist-info" / "METADATA").exists()
    (site / "carried" / "__init__.py").write_text("changed")
    assert gpu_check.install_wheels(wheels, tmp_path / "work") == site  # the same wheels: not unpacked again
    assert (site / "carried" / "__init__.py").read_text() == "changed"


def test_the_switches_turn_off_overlap_and_device_conversion_in_every_child():
    from argparse import Namespace

    assert gpu_check.switches(Namespace(no_overlap=False, no_convert_on_device=False)) == {}
    both = Namespace(no_overlap=True, no_convert_on_device=True)
    assert gpu_check.switches(both) == {"LOWMEM_HF_GPU_OVERLAP": "0", "LOWMEM_HF_GPU_CONVERT_ON_DEVICE": "0"}
