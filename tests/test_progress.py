"""One byte progress bar per load: on local rank 0 only, never where a library switch turned bars off."""

from __future__ import annotations

import huggingface_hub.utils as hf_utils
import pytest
import transformers
from transformers.utils import logging as hf_logging

from lowmem_hf import LowMemAutoModelForCausalLM


class RecordingBar:
    """A tqdm-compatible class that records what the loader draws."""

    made: list["RecordingBar"] = []

    def __init__(self, *, total, **kwargs):
        self.total, self.n, self.closed = total, 0, False
        RecordingBar.made.append(self)

    def update(self, n):
        self.n += n

    def close(self):
        self.closed = True


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    RecordingBar.made = []
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    yield
    hf_utils.enable_progress_bars()
    hf_logging.enable_progress_bar()


def _load(path):
    return LowMemAutoModelForCausalLM.from_pretrained(path, tqdm_class=RecordingBar, output_loading_info=True)


def _dcp_checkpoint(source: str, folder) -> str:
    """A one-process ``dcp.save`` of ``source`` with its config: a sharded training checkpoint."""
    from torch.distributed import checkpoint as dcp

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    dcp.save(model.state_dict(), checkpoint_id=str(folder), no_dist=True)
    model.config.save_pretrained(str(folder))
    return str(folder)


@pytest.mark.parametrize("fmt", ["sharded", "bin", "dcp"])
def test_bar_counts_every_byte_read_and_closes(make_checkpoint, tmp_path, fmt):
    # dcp: its reader counts its own bytes, which the bar must see too, or it stays at 0
    path = _dcp_checkpoint(make_checkpoint("llama", "sharded"), tmp_path / "dcp") if fmt == "dcp" else make_checkpoint("llama", fmt)
    _, report = _load(path)
    (bar,) = RecordingBar.made
    assert bar.total == bar.n == report.bytes_read - report.header_bytes > 0 and bar.closed


@pytest.mark.parametrize(
    "switch_off",
    [
        lambda mp: mp.setenv("LOCAL_RANK", "1"),  # torchrun's other ranks on this node
        lambda mp: hf_utils.disable_progress_bars(),
        lambda mp: hf_logging.disable_progress_bar(),
    ],
    ids=["local_rank_1", "huggingface_hub_disable_progress_bars", "transformers_disable_progress_bar"],
)
def test_no_bar_where_progress_is_switched_off(make_checkpoint, monkeypatch, switch_off):
    switch_off(monkeypatch)
    _load(make_checkpoint("llama", "sharded"))
    assert RecordingBar.made == []


def test_hf_hub_disable_progress_bars_env_is_honoured(make_checkpoint, monkeypatch):
    # huggingface_hub reads the variable at import; it is also what are_progress_bars_disabled() reports
    monkeypatch.setattr(hf_utils._tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    _load(make_checkpoint("llama", "sharded"))
    assert RecordingBar.made == []
