"""The declared version ranges are the tested ones, and lowmem_hf works on every release inside them.

CI runs the whole suite on three stacks (tox.ini): the oldest releases pyproject.toml admits on its lowest Python,
the pinned one (constraints.txt), and the newest the package index serves. These tests tie the declarations to
those stacks, so that widening a range without testing it, or a stack drifting outside the range, fails here.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import pickle
import re
import subprocess
import sys
import tomllib

import pytest
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import lowmem_hf
from lowmem_hf.compat import torch_api

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def declared_dependencies() -> list[Requirement]:
    return [Requirement(r) for r in _project()["dependencies"]]


def declared_python() -> SpecifierSet:
    return SpecifierSet(_project()["requires-python"])


def _floor(requirement: Requirement) -> str:
    floors = [s.version for s in requirement.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{requirement}: declare one lower bound (>=), the one the oldest stack tests"
    return floors[0]


def test_the_oldest_stack_pins_every_declared_floor_on_the_lowest_declared_python():
    with open(os.path.join(REPO, "constraints-oldest.txt"), encoding="utf-8") as f:
        pins = dict(re.findall(r"^([\w.-]+)==(\S+)", f.read(), re.M))
    for requirement in declared_dependencies():
        assert requirement.name in pins and Version(pins[requirement.name]) == Version(_floor(requirement)), (requirement, pins)
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(os.path.join(REPO, "tox.ini"))
    floor = next(s.version for s in declared_python() if s.operator == ">=")
    assert tox["testenv:oldest"]["base_python"].strip() == f"python{floor}"


def test_this_stack_is_inside_the_declared_ranges():
    # the versions this stack runs, so that the log of each stack says them next to the outcome
    installed = {r.name: importlib.metadata.version(r.name) for r in declared_dependencies()}
    outside = {n: v for n, v in installed.items() if not next(r for r in declared_dependencies() if r.name == n).specifier.contains(v, prereleases=True)}
    assert outside == {}, f"installed outside pyproject.toml's ranges: {outside}"
    assert declared_python().contains(f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}")


def test_a_plain_load_in_a_fresh_interpreter_is_transformers_model(make_checkpoint):
    # torch 2.11 could not import lowmem_hf at all: a module of the load path imported a private torch name that
    # release lacks. A fresh interpreter, as a user's script starts, on this stack's torch.
    path = make_checkpoint("llama", "safetensors")
    script = (
        "import sys, torch, transformers\n"
        "from lowmem_hf import LowMemAutoModelForCausalLM\n"
        "torch.manual_seed(0)\n"
        "got = LowMemAutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16)\n"
        "torch.manual_seed(0)\n"
        "ref = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)\n"
        "same = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got.state_dict().values(), ref.state_dict().values()))\n"
        "print('SAME' if same and list(got.state_dict()) == list(ref.state_dict()) else 'DIFFERENT', torch.__version__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, path], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split()[0] == "SAME", done.stdout


def test_a_missing_upstream_name_is_a_named_error_where_it_is_used(monkeypatch):
    # a torch without the c10d store getter: the cooperative fetch says what it needs, what it found and what to do
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(lowmem_hf.UpstreamAPIError) as raised:
        torch_api.default_store()
    error = raised.value
    assert error.needs == "torch.distributed.distributed_c10d._get_default_store"
    assert error.found.startswith("torch ") and "fetch='files'" in error.fix
    assert str(error).startswith("the cooperative fetch's status exchange needs torch.distributed.distributed_c10d.")
    copy = pickle.loads(pickle.dumps(error))  # errors cross ranks and child processes
    assert type(copy) is type(error) and str(copy) == str(error) and copy.fix == error.fix


def test_the_floor_of_torch_is_no_higher_than_the_gpu_machine_s_release():
    # torch 2.11 is what the project's GPU machine and GPU base images of a few months ago carry
    torch_floor = Version(_floor(next(r for r in declared_dependencies() if r.name == "torch")))
    assert torch_floor <= Version("2.11")


def test_a_status_round_reads_every_rank_s_key_in_one_round_trip_where_the_store_can():
    store = dist.HashStore()
    for r in range(4):
        store.set(f"round/{r}", f"s{r}")
    keys = [f"round/{r}" for r in range(4)]
    assert torch_api.store_values(store, keys) == [b"s0", b"s1", b"s2", b"s3"]

    class KeyByKey:  # a store without multi_get (an older or a Python store): the same values, one get each
        gets = 0

        def get(self, key):
            KeyByKey.gets += 1
            return store.get(key)

    assert torch_api.store_values(KeyByKey(), keys) == [b"s0", b"s1", b"s2", b"s3"] and KeyByKey.gets == 4
