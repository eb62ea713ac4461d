"""The commit protocol of a save, driven without a model: new files are written aside, switched into place only at
the end, so that the folder loads the old checkpoint or the new one at every instant, and a failed save leaves the
folder as it was.

Each weight file here holds the name of the save that wrote it ("old" or "new"), so that what a loader would read
at any instant can be told apart.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from lowmem_hf.save.agree import agree
from lowmem_hf.save.commit import (
    SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, STAGING, Staging, live_weights, prepare_directory, switch_gathered,
    switch_rank_files,
)

LAYOUTS = {  # the weight files of a checkpoint, by layout
    "one file": [SAFE_WEIGHTS_NAME],
    "2 shards": [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)],
    "4 shards": [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)],
    "rank files": [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)],
}


def _stage(directory, layout: str, generation: str) -> tuple[Staging, dict | None]:
    """A save of ``layout`` written aside (each file holding ``generation``), and its index if it has one."""
    os.makedirs(directory, exist_ok=True)
    assert prepare_directory(str(directory)) is None
    staging = Staging(str(directory), weight_bytes=100, writer=True, max_shard_size_applies=layout != "rank files")
    names = LAYOUTS[layout]
    for name in names:
        staging.write_file(name, generation.encode(), weights=True)
    index = None
    if layout.endswith("shards"):
        index = {"metadata": {"generation": generation}, "weight_map": {f"t{i}": name for i, name in enumerate(names)}}
        staging.write_file(SAFE_WEIGHTS_INDEX_NAME, json.dumps(index).encode())
    return staging, index


def _commit(directory, layout: str, generation: str) -> None:
    """A whole save of ``layout``: written aside, switched, the staging folder removed."""
    staging, index = _stage(directory, layout, generation)
    try:
        if layout == "rank files":
            switch_rank_files(staging, None, 0, keep=set(staging.names))
        else:
            switch_gathered(staging, index)
    finally:
        staging.discard()


def _read(path) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _loads(directory) -> str:
    """What a loader reads in ``directory``: "old", "new", "nothing" (no complete checkpoint) or "a mix".

    Read as transformers reads it: ``model.safetensors`` first, else the index and the files it names, else every
    rank file."""
    one = _read(os.path.join(directory, SAFE_WEIGHTS_NAME))
    if one is not None:
        return one
    index = _read(os.path.join(directory, SAFE_WEIGHTS_INDEX_NAME))
    if index is not None:
        index = json.loads(index)
        found = {_read(os.path.join(directory, name)) for name in index["weight_map"].values()}
        found.add(index["metadata"]["generation"])
    else:
        found = {_read(os.path.join(directory, n)) for n in os.listdir(directory) if n.startswith("shard-")}
    if None in found or not found:
        return "nothing"
    return found.pop() if len(found) == 1 else "a mix"


def _contents(directory) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.relpath(os.path.join(root, name), directory)] = f.read()
    return out


def test_files_written_aside_are_invisible_until_the_switch(tmp_path):
    _commit(tmp_path, "2 shards", "old")
    before = _contents(tmp_path)
    staging, index = _stage(tmp_path, "2 shards", "new")
    assert sorted(os.listdir(tmp_path)) == sorted([*before, STAGING])
    assert {n: b for n, b in _contents(tmp_path).items() if not n.startswith(STAGING)} == before
    assert _loads(tmp_path) == "old"
    switch_gathered(staging, index)
    assert _loads(tmp_path) == "new"
    staging.discard()
    assert sorted(os.listdir(tmp_path)) == sorted([*LAYOUTS["2 shards"], SAFE_WEIGHTS_INDEX_NAME])


@pytest.mark.parametrize("old_layout", ["one file", "4 shards", "rank files"])
def test_a_failure_discards_the_staging_folder_and_leaves_the_old_checkpoint_as_it_was(tmp_path, monkeypatch, old_layout):
    _commit(tmp_path, old_layout, "old")
    before = _contents(tmp_path)
    staging, _ = _stage(tmp_path, "2 shards", "new")

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    staging.write_file("model-00003-of-00003.safetensors", b"new", weights=True)
    monkeypatch.undo()
    assert staging.create("model-00004-of-00004.safetensors", 3) is None  # a failed rank writes nothing more
    with pytest.raises(OSError, match="could not write the checkpoint") as raised:
        agree(staging.failure, None, what="write the checkpoint", outcome="nothing changed", cause=staging.cause)
    staging.discard()
    assert raised.value.errno == errno.ENOSPC
    assert str(tmp_path / "model-00003-of-00003.safetensors") in str(raised.value)  # the final path, not the staging one
    assert "The file needs 3 bytes" in str(raised.value) and "need 100 bytes in all" in str(raised.value)
    assert _contents(tmp_path) == before and _loads(tmp_path) == "old"


@pytest.mark.parametrize("new_layout", ["one file", "2 shards", "4 shards", "rank files"])
@pytest.mark.parametrize("old_layout", ["one file", "2 shards", "4 shards", "rank files"])
def test_a_second_save_over_a_live_checkpoint_ends_with_exactly_the_new_files(tmp_path, old_layout, new_layout):
    _commit(tmp_path, old_layout, "old")
    _commit(tmp_path, new_layout, "new")
    index = [SAFE_WEIGHTS_INDEX_NAME] if new_layout.endswith("shards") else []
    assert sorted(os.listdir(tmp_path)) == sorted(LAYOUTS[new_layout] + index)
    assert _loads(tmp_path) == "new"


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard links", "no hard links"])
@pytest.mark.parametrize("new_layout", ["one file", "2 shards", "4 shards"])
@pytest.mark.parametrize("old_layout", ["one file", "4 shards"])
def test_every_instant_of_the_switch_loads_the_old_or_the_new_checkpoint(tmp_path, monkeypatch, old_layout, new_layout, hard_links):
    """Where the file system has no hard links, a re-save over the same shard names goes through an instant where
    nothing loads; never through one that mixes two saves."""
    _commit(tmp_path, old_layout, "old")
    staging, index = _stage(tmp_path, new_layout, "new")
    seen = [_loads(tmp_path)]

    def watched(real):
        def call(*args, **kwargs):
            if not hard_links and real is os_link:
                raise OSError(errno.EPERM, "Operation not permitted")
            result = real(*args, **kwargs)
            seen.append(_loads(tmp_path))
            return result
        return call

    os_link = os.link
    for name in ("replace", "remove", "link"):
        monkeypatch.setattr(os, name, watched(getattr(os, name)))
    switch_gathered(staging, index)
    monkeypatch.undo()
    staging.discard()
    states = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
    allowed = (["old", "new"], ["old", "nothing", "new"]) if not hard_links and old_layout == new_layout else (["old", "new"],)
    assert states in allowed, seen


def test_rank_files_of_an_earlier_save_with_more_ranks_and_a_hub_checkpoint_are_removed(tmp_path):
    _commit(tmp_path, "4 shards", "old")
    for r in (1, 2, 3, 4):
        (tmp_path / f"shard-0000{r}-model-00001-of-00001.safetensors").write_text("older")
    _commit(tmp_path, "rank files", "new")
    assert sorted(os.listdir(tmp_path)) == LAYOUTS["rank files"]
    assert _loads(tmp_path) == "new"


def test_preparing_a_folder_removes_what_a_killed_save_left_aside(tmp_path):
    _commit(tmp_path, "one file", "old")
    _stage(tmp_path, "4 shards", "new")  # killed before the switch: never discarded
    assert STAGING in os.listdir(tmp_path)
    assert prepare_directory(str(tmp_path)) is None
    assert os.listdir(tmp_path) == [SAFE_WEIGHTS_NAME] and _loads(tmp_path) == "old"


def test_a_folder_that_cannot_be_created_is_a_failure_named_before_anything_is_written(tmp_path):
    (tmp_path / "file").write_text("")
    failure = prepare_directory(str(tmp_path / "file" / "out"))
    assert failure is not None and failure.errno == errno.ENOTDIR and str(tmp_path / "file" / "out") in failure.text
    with pytest.raises(NotADirectoryError, match="could not prepare the save directory, nothing was written"):
        agree(failure, None, what="prepare the save directory", outcome="nothing was written")


def test_live_weights_are_model_safetensors_first_else_the_index_and_what_it_names(tmp_path):
    assert live_weights(str(tmp_path)) == set()
    _commit(tmp_path, "2 shards", "old")
    assert live_weights(str(tmp_path)) == {SAFE_WEIGHTS_INDEX_NAME, *LAYOUTS["2 shards"]}
    (tmp_path / SAFE_WEIGHTS_NAME).write_text("older")
    assert live_weights(str(tmp_path)) == {SAFE_WEIGHTS_NAME}
