"""The lowmem_hf logger follows transformers' verbosity: one info line per load on rank 0, a warning for keys.

Where the line goes: in a library it propagates to the application's logging (lowmem_hf prints it on stderr
itself only when there is none); under ``lowmem-hf run`` it is on stderr as ``[lowmem_hf] ...``, once, whatever
logging the script configures.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
from transformers.utils import logging as hf_logging

from lowmem_hf import LowMemAutoModelForCausalLM, LowMemAutoModelForSequenceClassification


@pytest.fixture
def records(caplog):
    """lowmem_hf's records (pytest's handler sits on the root logger; the verbosity filter still applies)."""
    caplog.set_level(logging.DEBUG, logger="lowmem_hf")
    before = hf_logging.get_verbosity()
    yield lambda: [r for r in caplog.records if r.name == "lowmem_hf"]
    hf_logging.set_verbosity(before)


def test_info_line_appears_only_at_transformers_info_verbosity(make_checkpoint, records):
    path = make_checkpoint("llama", "safetensors")
    hf_logging.set_verbosity_warning()
    LowMemAutoModelForCausalLM.from_pretrained(path)
    assert records() == []
    hf_logging.set_verbosity_info()
    LowMemAutoModelForCausalLM.from_pretrained(path)
    [line] = records()
    assert line.levelno == logging.INFO and line.getMessage().startswith("lowmem_hf loaded LlamaForCausalLM from ")


def test_missing_keys_are_warned_about_by_name_unless_transformers_is_quiet(make_checkpoint, records):
    path = make_checkpoint("bert", "sharded")  # a base BERT checkpoint: the classifier head is not in it
    hf_logging.set_verbosity_warning()
    model = LowMemAutoModelForSequenceClassification.from_pretrained(path)
    [warning] = records()
    assert warning.levelno == logging.WARNING
    assert "2 missing keys, newly initialized (classifier.bias, classifier.weight)" in warning.getMessage()
    assert "7 unexpected keys, not loaded (cls.predictions.bias, " in warning.getMessage()  # the MLM/NSP heads
    assert model.lowmem_report.missing_keys == {"classifier.bias", "classifier.weight"}
    hf_logging.set_verbosity_error()
    LowMemAutoModelForSequenceClassification.from_pretrained(path)
    assert len(records()) == 1


def test_ranks_other_than_zero_stay_silent(make_checkpoint, records, monkeypatch):
    monkeypatch.setenv("RANK", "1")  # torchrun's rank before (or without) a process group
    hf_logging.set_verbosity_info()
    LowMemAutoModelForSequenceClassification.from_pretrained(make_checkpoint("bert", "sharded"))
    assert records() == []


# ---- where the line goes: a script's own logging, with and without `lowmem-hf run` -----------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD_LINE = "lowmem_hf loaded LlamaForCausalLM from "

# How scripts set up logging. "run_clm" is transformers' examples/pytorch/language-modeling/run_clm.py's call, with
# level=INFO added (run_clm sets its levels per logger), so a line that reached the root's handler would be printed.
LOGGING_SETUPS = {
    "none": "",
    "run_clm": """
        logging.basicConfig(
            format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
            datefmt="%m/%d/%Y %H:%M:%S",
            handlers=[logging.StreamHandler(sys.stdout)],
            level=logging.INFO,
        )
    """,
    # disable_existing_loggers defaults to True: every logger that exists and is not named is switched off
    "dictConfig": """
        logging.config.dictConfig({
            "version": 1,
            "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
            "handlers": {"out": {"class": "logging.StreamHandler", "stream": "ext://sys.stdout", "formatter": "plain"}},
            "root": {"handlers": ["out"], "level": "INFO"},
        })
    """,
}


def _script(tmp_path, setup: str, *, library: bool) -> str:
    """A script that sets up its logging, logs one line of its own and loads a model with transformers' API."""
    switch = "import lowmem_hf\nlowmem_hf.patch_transformers()\ntransformers.logging.set_verbosity_info()\n" if library else ""
    path = tmp_path / "load_with_own_logging.py"
    path.write_text(
        "import logging, logging.config, sys\nimport transformers\nfrom transformers import AutoModelForCausalLM\n"
        + textwrap.dedent(LOGGING_SETUPS[setup])
        + switch
        + "logging.getLogger('__main__').info('the script logs this')\n"
        + "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        + "assert hasattr(model, 'lowmem_report'), 'lowmem_hf did not load the model'\n"
    )
    return str(path)


def _run(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRANSFORMERS_VERBOSITY")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
    proc = subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _lines_with(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


@pytest.mark.parametrize("setup", sorted(LOGGING_SETUPS))
def test_under_lowmem_hf_run_the_load_line_is_on_stderr_once_whatever_logging_the_script_configures(
    make_checkpoint, tmp_path, setup
):
    script = _script(tmp_path, setup, library=False)
    proc = _run([sys.executable, "-m", "lowmem_hf", "run", script, make_checkpoint("llama", "safetensors")], tmp_path)
    [line] = _lines_with(proc.stderr, "lowmem_hf loaded")
    assert line.startswith("[lowmem_hf] " + LOAD_LINE)  # lowmem_hf's format, not the script's
    assert _lines_with(proc.stdout, "lowmem_hf loaded") == []  # not passed to the script's handler as well
    if setup != "none":
        assert _lines_with(proc.stdout, "the script logs this")  # the script's own logging is untouched


def test_in_a_library_the_load_line_goes_to_the_applications_logging_in_its_format(make_checkpoint, tmp_path):
    script = _script(tmp_path, "run_clm", library=True)
    proc = _run([sys.executable, script, make_checkpoint("llama", "safetensors")], tmp_path)
    [line] = _lines_with(proc.stdout, "lowmem_hf loaded")
    assert f" - INFO - lowmem_hf - {LOAD_LINE}" in line
    assert _lines_with(proc.stderr, "lowmem_hf loaded") == []


def test_in_a_library_without_logging_configured_lowmem_hf_prints_the_load_line_on_stderr(make_checkpoint, tmp_path):
    script = _script(tmp_path, "none", library=True)
    proc = _run([sys.executable, script, make_checkpoint("llama", "safetensors")], tmp_path)
    [line] = _lines_with(proc.stderr, "lowmem_hf loaded")
    assert line.startswith("[lowmem_hf] " + LOAD_LINE)
    assert _lines_with(proc.stdout, "lowmem_hf loaded") == []
