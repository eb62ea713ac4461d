"""Property: whatever bytes, arguments or faults a load meets, it returns the intact model bit for bit or raises a
named lowmem_hf error, in time and without dying; and whatever stops a save, the folder loads as the old or the new
checkpoint, whole (integrity issue, item 7).

hypothesis draws each trial's choices (tests/integrity_fuzz.py: corrupt safetensors headers, index files, DCP
metadata of both kinds, config.json fields, from_pretrained arguments, truncation mid-load of every format and
source, a loopback Hub that corrupts, cuts, fails or changes files, a full disk and a kill during a save); every trial runs in a child process of its own with a time limit, so a
signal or a hang fails the test. Derandomized and bounded for CI; a longer run is one command:

    LOWMEM_FUZZ=long LOWMEM_FUZZ_EXAMPLES=200 pytest tests/test_integrity_properties.py

(``python benchmarks/fuzz_integrity.py`` runs the same generators and prints the outcomes table.)
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import integrity_fuzz as fuzz

LONG = os.environ.get("LOWMEM_FUZZ") == "long"
EXAMPLES = int(os.environ.get("LOWMEM_FUZZ_EXAMPLES", "200")) if LONG else None
# trials per category in CI (290 in all, ~2-3 minutes on 2 busy cores): a trial is a fork of the preloaded fork server
# loading a tiny Llama, well under a second; a save trial saves and loads up to three times
CI_EXAMPLES = {
    "safetensors header": 40, "index": 40, "dcp metadata": 40, "config": 40, "arguments": 40, "truncation": 40,
    "hub faults": 20, "disk full": 15, "kill during save": 15,
}


def _settings(category: str):
    return settings(
        max_examples=EXAMPLES or CI_EXAMPLES[category],
        derandomize=not LONG,  # CI: the same trials every run; long runs explore
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    workspace = fuzz.build_workspace(str(root / "checkpoints"))
    return fuzz.Runner(workspace, str(root))


def _property(category: str):
    """The property, for the trials of one category: each loads intact (or as transformers loads the same input) or
    raises a named error; a save leaves the old or the new checkpoint."""

    @_settings(category)
    @given(data=st.data())
    def test(runner, data):
        trial = fuzz.draw_trial(category, fuzz.DrawPick(data))
        outcome = runner.run(trial)
        assert outcome.kind in fuzz.OK, f"{category}: {trial.label} -> {outcome.kind}: {outcome.detail}"

    return test


test_a_corrupt_safetensors_header_loads_intact_or_is_named = _property("safetensors header")
test_a_corrupt_index_loads_intact_or_is_named = _property("index")
test_corrupt_dcp_metadata_of_either_kind_loads_intact_or_is_named = _property("dcp metadata")
test_a_nonsense_config_loads_as_transformers_does_or_is_named = _property("config")
test_any_arguments_load_as_transformers_does_or_are_named = _property("arguments")
test_a_file_cut_mid_load_of_any_format_and_source_is_named_not_a_crash = _property("truncation")
test_a_hub_that_corrupts_cuts_fails_or_changes_files_loads_intact_or_is_named = _property("hub faults")
test_a_full_disk_during_a_re_save_leaves_the_old_or_the_new_checkpoint = _property("disk full")
test_a_kill_during_a_re_save_leaves_the_old_or_the_new_checkpoint = _property("kill during save")


def test_the_runner_sees_a_crash_and_a_hang(runner):
    """The property is only as good as the child's verdicts: a signal and a time-out are caught, not missed."""
    quick = fuzz.Runner(runner.workspace, runner.scratch_root, seconds=3)
    assert quick.run(fuzz.Trial("self-test", "_die", dict(how="signal"))).kind == "crash"
    assert quick.run(fuzz.Trial("self-test", "_die", dict(how="hang"))).kind == "hang"
