"""The lowmem_hf logger follows transformers' verbosity: one info line per load on rank 0, a warning for keys."""

from __future__ import annotations

import logging

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
