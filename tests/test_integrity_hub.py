"""Integrity: a load reads only files inside its checkpoint, and its Hub reads are retried and checked.

Weight files named outside the folder (``config.transformers_weights``, index entries with ``..``, absolute paths,
escaping symlinks) are refused before any byte is read; header Range reads retry as body reads do (the loopback
fake Hub of tests/hub_server.py).
"""

import json
import os
import shutil
import sys

import pytest
import torch
from huggingface_hub import snapshot_download

import lowmem_hf
from lowmem_hf.errors import CorruptCheckpointError, OutsideCheckpointError

Causal = lowmem_hf.LowMemAutoModelForCausalLM

# Every file opened (``open`` audit events: builtins.open, io.open, os.open) while a test watches. An audit hook
# cannot be removed, so it is installed once and does nothing unless a test's ``opened`` fixture is active.
_WATCH: list[str] | None = None


def _audit(event, args):
    if _WATCH is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _WATCH.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


@pytest.fixture
def opened():
    """The real paths of every file opened during the test."""
    global _WATCH
    _WATCH = []
    try:
        yield _WATCH
    finally:
        _WATCH = None


def copy_of(folder, dst):
    shutil.copytree(folder, dst)
    return dst


def assert_same(got, expected):
    a, b = got.state_dict(), expected.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# --------------------------------------------------------------------------------------------- local folders


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_transformers_weights_outside_the_folder_is_refused_before_any_read(make_checkpoint, tmp_path, opened, where):
    model = copy_of(make_checkpoint("llama", "safetensors"), tmp_path / "model")
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(model / "model.safetensors", outside / "x.safetensors")
    entry = "../outside/x.safetensors" if where == "relative" else str(outside / "x.safetensors")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "transformers_weights": entry}))

    opened.clear()  # what the test itself opened to set up
    with pytest.raises(OutsideCheckpointError) as e:
        Causal.from_pretrained(model)
    msg = str(e.value)
    assert f"config.json's transformers_weights names {entry!r}" in msg
    assert str(outside / "x.safetensors") in msg and f"outside the checkpoint folder {model}" in msg
    assert "copy (or hard-link) the file into the folder" in msg
    assert isinstance(e.value, ValueError)  # what transformers raises for it
    assert str(outside / "x.safetensors") not in opened


def test_variant_that_leads_outside_the_folder_is_refused(make_checkpoint, tmp_path):
    model = copy_of(make_checkpoint("llama", "safetensors"), tmp_path / "model")
    with pytest.raises(OutsideCheckpointError, match=r"The weight file is 'model\./\.\./\.\./x\.safetensors'"):
        Causal.from_pretrained(model, variant="/../../x")


def _index_pointing_outside(model, outside, how):
    """Move shard 2 of a sharded Llama out of ``model`` and point the index (or a symlink) at it; its entry."""
    shard = "model-00002-of-00003.safetensors"
    shutil.move(model / shard, outside / shard)
    if how == "symlink":
        os.symlink(outside / shard, model / shard)
        return shard
    entry = f"../{outside.name}/{shard}" if how == "dotdot" else str(outside / shard)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: entry if v == shard else v for k, v in index["weight_map"].items()}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return entry


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_entry_outside_the_folder_is_refused_naming_it(make_checkpoint, tmp_path, opened, how):
    model = copy_of(make_checkpoint("llama", "sharded"), tmp_path / "model")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first_key = next(k for k, v in index["weight_map"].items() if v == "model-00002-of-00003.safetensors")
    entry = _index_pointing_outside(model, outside, how)

    opened.clear()  # what the test itself opened to set up
    with pytest.raises(OutsideCheckpointError) as e:
        Causal.from_pretrained(model)
    msg = str(e.value)
    assert f"model.safetensors.index.json maps {first_key!r}" in msg and f"to {entry!r}" in msg
    assert str(outside / "model-00002-of-00003.safetensors") in msg and str(model) in msg
    if how == "symlink":
        assert "a symlink to" in msg
    # refused before any shard was opened: neither the one outside nor the ones inside
    assert not [p for p in opened if p.endswith(".safetensors")], opened


def test_a_folder_that_is_a_snapshot_of_the_hf_cache_loads(hf_hub, make_checkpoint):
    # snapshot files are symlinks into the repo's blobs, outside the snapshot folder: that is the cache's layout
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    snapshot = snapshot_download("org/llama")
    assert os.path.islink(os.path.join(snapshot, "model-00001-of-00003.safetensors"))
    assert_same(Causal.from_pretrained(snapshot), Causal.from_pretrained(local))


# --------------------------------------------------------------------------------------------- Hub repos


def test_header_range_read_cut_on_every_try_is_retried_then_a_named_error(hf_hub, make_checkpoint):
    hf_hub.add_repo("org/llama", make_checkpoint("llama", "sharded"))
    name = "model-00001-of-00003.safetensors"
    hf_hub.cut_next(0, count=None, path=name)  # every body of that file ends before its first byte
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained("org/llama")
    msg = str(e.value)
    assert name in msg and "got 0 of 8 bytes at offset 0 after 5 attempts" in msg and "keeps dropping" in msg
    assert len([r for r in hf_hub.requests if r.filename == name and r.method == "GET"]) == 5


def test_header_range_read_cut_twice_is_retried_and_loads(hf_hub, make_checkpoint):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    name = "model-00001-of-00003.safetensors"
    hf_hub.cut_next(0, count=2, path=name)
    assert_same(Causal.from_pretrained("org/llama", fetch="ranges"), Causal.from_pretrained(local))
    assert sum(r.cut for r in hf_hub.requests if r.filename == name) == 2
