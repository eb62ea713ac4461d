"""Integrity: a load reads only files inside its checkpoint, and never keeps or reads a corrupt Hub download.

Local folders and Hub repos (the loopback fake Hub of tests/hub_server.py): weight files named outside the folder
(``config.transformers_weights``, index entries with ``..``, absolute paths, escaping symlinks) are refused before
any byte is read; files downloaded during a load are checked against the sha256 the Hub publishes (LFS ETag) and
against the etag the load was planned with; header Range reads retry as body reads do.
"""

import json
import os
import re
import shutil
import sys

import pytest
import torch
from huggingface_hub import snapshot_download

import lowmem_hf
import lowmem_hf.fetch.cache
from hub_server import HF_DEFAULT_LFS_PATTERNS
from lowmem_hf.errors import CorruptDownloadError, HubConnectionError, OutsideCheckpointError, RemoteFileChangedError
from lowmem_hf.request import make_request

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


def flipped(data: bytes, nbytes: int = 16) -> bytes:
    """``data`` with ``nbytes`` bytes in the middle inverted (what the fake Hub's ``corrupt_next`` sends)."""
    at = len(data) // 2 - nbytes // 2
    return data[:at] + bytes(b ^ 0xFF for b in data[at : at + nbytes]) + data[at + nbytes :]


def cache_files(hf_home):
    """Every file (and link) under the HF cache: {name: [paths]}."""
    found = {}
    for root, _, files in os.walk(os.path.join(hf_home, "hub")):
        for f in files:
            found.setdefault(f, []).append(os.path.join(root, f))
    return found


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


@pytest.fixture
def lfs_hub(hf_hub):
    """The fake Hub serving weight files as LFS files, as a real repo's .gitattributes does: ETag = sha256."""
    hf_hub.lfs_patterns = HF_DEFAULT_LFS_PATTERNS
    return hf_hub


def shard_of(fmt):
    return "model-00002-of-00003.safetensors" if fmt == "sharded" else "pytorch_model-00002-of-00003.bin"


def whole_gets(server, name):
    return [r for r in server.requests if r.filename == name and r.method == "GET" and r.range is None]


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_download_corrupted_in_transit_is_fetched_once_more(lfs_hub, make_checkpoint, fmt):
    local = make_checkpoint("llama", fmt)
    lfs_hub.add_repo("org/llama", local)
    name = shard_of(fmt)
    lfs_hub.corrupt_next(1, path=name)
    got = Causal.from_pretrained("org/llama")
    assert_same(got, Causal.from_pretrained(local))
    assert [r.corrupted for r in whole_gets(lfs_hub, name)] == [True, False]


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_download_corrupted_twice_is_a_named_error_and_leaves_nothing_in_the_cache(lfs_hub, make_checkpoint, tmp_path, fmt):
    local = make_checkpoint("llama", fmt)
    lfs_hub.add_repo("org/llama", local)
    name = shard_of(fmt)
    sha256 = lfs_hub.file_etag("org/llama", name)
    lfs_hub.corrupt_next(None, path=name)
    with pytest.raises(CorruptDownloadError) as e:
        Causal.from_pretrained("org/llama")
    msg = str(e.value)
    assert name in msg and f"publishes sha256 {sha256}" in msg and "removed from the HF cache" in msg
    assert len(whole_gets(lfs_hub, name)) == 2  # fetched once more, then given up
    cached = cache_files(tmp_path / "hf_home")
    assert name not in cached and sha256 not in cached and not [f for f in cached if ".incomplete" in f]

    # the next load does not reuse anything corrupt: it downloads the file again and gets the right model
    lfs_hub.clear_faults()
    assert_same(Causal.from_pretrained("org/llama"), Causal.from_pretrained(local))


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_etag_that_changes_between_metadata_and_download_is_remote_file_changed(lfs_hub, make_checkpoint, tmp_path, fmt):
    local = make_checkpoint("llama", fmt)
    sha = lfs_hub.add_repo("org/llama", local)
    name = shard_of(fmt)
    planned = lfs_hub.file_etag("org/llama", name)
    changed = flipped(open(os.path.join(local, name), "rb").read())  # same size, other bytes, another etag

    def planned_and_header_read(record) -> bool:  # the last request of the plan: the HEAD (.bin), the header read
        if record.filename != name:
            return False
        return record.method == "HEAD" if fmt == "bin" else record.method == "GET" and record.range is not None

    lfs_hub.replace_file("org/llama", name, changed, when=planned_and_header_read)
    with pytest.raises(RemoteFileChangedError) as e:
        Causal.from_pretrained("org/llama", fetch="files")
    now = lfs_hub.file_etag("org/llama", name)
    msg = str(e.value)
    assert name in msg and f"planned for etag {planned}" in msg and f"downloaded with etag {now}" in msg
    cached = cache_files(tmp_path / "hf_home")
    assert name not in cached and now not in cached
    assert lfs_hub.commit_sha("org/llama") == sha


def test_verify_downloads_false_skips_hashing(lfs_hub, make_checkpoint, monkeypatch):
    local = make_checkpoint("llama", "sharded")
    lfs_hub.add_repo("org/llama", local)
    hashed = []
    real = lowmem_hf.fetch.cache.file_sha256
    monkeypatch.setattr(lowmem_hf.fetch.cache, "file_sha256", lambda path, **kw: hashed.append(path) or real(path, **kw))

    assert_same(Causal.from_pretrained("org/llama", verify_downloads=False), Causal.from_pretrained(local))
    assert hashed == []
    assert make_request(Causal, "org/llama").verify_downloads is True
    with pytest.raises(ValueError, match="verify_downloads must be True or False, got 'no'"):
        make_request(Causal, "org/llama", verify_downloads="no")


def test_each_downloaded_file_is_hashed_once_and_cached_files_not_again(lfs_hub, make_checkpoint, monkeypatch):
    local = make_checkpoint("llama", "sharded")
    lfs_hub.add_repo("org/llama", local)
    hashed = []
    real = lowmem_hf.fetch.cache.file_sha256
    monkeypatch.setattr(lowmem_hf.fetch.cache, "file_sha256", lambda path, **kw: hashed.append(os.path.basename(path)) or real(path, **kw))
    Causal.from_pretrained("org/llama")
    assert sorted(hashed) == sorted(f for f in os.listdir(local) if f.endswith(".safetensors"))
    hashed.clear()
    Causal.from_pretrained("org/llama")  # all from the cache now
    assert hashed == []


def test_header_range_read_cut_on_every_try_is_retried_then_a_named_error(hf_hub, make_checkpoint):
    hf_hub.add_repo("org/llama", make_checkpoint("llama", "sharded"))
    name = "model-00001-of-00003.safetensors"
    hf_hub.cut_next(0, count=None, path=name)  # every body of that file ends before its first byte
    with pytest.raises(HubConnectionError) as e:
        Causal.from_pretrained("org/llama")
    msg = str(e.value)
    # the first read asks for the length prefix and about the header's size at once (hub._header_estimate)
    assert name in msg and re.search(r"got 0 of \d+ bytes at offset 0 after 5 attempts", msg) and "keeps dropping" in msg
    assert len([r for r in hf_hub.requests if r.filename == name and r.method == "GET"]) == 5


def test_header_range_read_cut_twice_is_retried_and_loads(hf_hub, make_checkpoint):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    name = "model-00001-of-00003.safetensors"
    hf_hub.cut_next(0, count=2, path=name)
    assert_same(Causal.from_pretrained("org/llama", fetch="ranges"), Causal.from_pretrained(local))
    assert sum(r.cut for r in hf_hub.requests if r.filename == name) == 2


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_hub_index_entry_outside_the_repo_is_refused_naming_it(hf_hub, make_checkpoint, tmp_path, how):
    repo = copy_of(make_checkpoint("llama", "sharded"), tmp_path / "repo")
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    entry = "../../../../../outside.safetensors" if how == "dotdot" else "/etc/outside.safetensors"
    first_key = next(k for k, v in index["weight_map"].items() if v == "model-00002-of-00003.safetensors")
    index["weight_map"] = {k: entry if v == "model-00002-of-00003.safetensors" else v for k, v in index["weight_map"].items()}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_hub.add_repo("org/llama", repo)
    hf_hub.reset_counters()
    with pytest.raises(OutsideCheckpointError) as e:
        Causal.from_pretrained("org/llama")
    msg = str(e.value)
    assert f"model.safetensors.index.json maps {first_key!r}" in msg and f"to {entry!r}" in msg and "'org/llama'" in msg
    assert not [r for r in hf_hub.requests if "outside" in r.path or "-of-" in r.path]  # no shard asked for


def test_cached_hub_file_that_links_outside_the_repo_cache_is_refused(hf_hub, make_checkpoint, tmp_path, opened):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    Causal.from_pretrained("org/llama")
    name = "model-00002-of-00003.safetensors"
    (pointer,) = cache_files(tmp_path / "hf_home")[name]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(os.path.join(local, name), outside)
    os.remove(pointer)
    os.symlink(outside, pointer)  # a tampered cache
    opened.clear()
    with pytest.raises(OutsideCheckpointError) as e:
        Causal.from_pretrained("org/llama")
    assert f"{name!r}: a symlink to {outside}" in str(e.value) and "models--org--llama" in str(e.value)
    assert str(outside) not in opened


def test_files_download_on_the_calling_thread_under_hf_deactivate_async_load(lfs_hub, make_checkpoint, monkeypatch):
    import lowmem_hf.fetch

    local = make_checkpoint("llama", "sharded")
    lfs_hub.add_repo("org/llama", local)
    monkeypatch.setenv("HF_DEACTIVATE_ASYNC_LOAD", "1")
    monkeypatch.setattr(lowmem_hf.fetch, "ThreadPoolExecutor", None)  # starting download threads would fail
    assert_same(Causal.from_pretrained("org/llama"), Causal.from_pretrained(local))
