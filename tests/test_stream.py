"""The readers: chunked conversion is exact at any chunk size, .bin streams shard by shard, nothing stays mapped."""

import mmap
import os

import pytest
import torch
import transformers

from lowmem_hf.auto import AUTO_CLASSES
from lowmem_hf.stream import _release_pages, chunk_spans

Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]


@pytest.mark.parametrize(
    "numel,itemsize,chunk,expected",
    [
        (10, 4, 16, [(0, 4), (4, 8), (8, 10)]),
        (3, 4, 1, [(0, 1), (1, 2), (2, 3)]),  # a chunk smaller than an element still moves one element
        (0, 2, 16, []),
        (5, 2, 100, [(0, 5)]),
    ],
)
def test_chunk_spans_cover_every_element_once(numel, itemsize, chunk, expected):
    assert chunk_spans(numel, itemsize, chunk) == expected


@pytest.mark.parametrize("chunk_bytes", [1, 1000, 4096 + 6])
@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_conversion_is_exact_at_any_chunk_size(make_checkpoint, fmt, chunk_bytes):
    # The same staged path serves CUDA destinations (through a pinned buffer); here it runs on CPU.
    path = make_checkpoint("llama", fmt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, chunk_bytes=chunk_bytes)
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


def test_same_dtype_load_leaves_no_file_backed_parameter(make_checkpoint):
    path = make_checkpoint("llama", "sharded")
    model = Causal.from_pretrained(path, torch_dtype=torch.float32)
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if path in line]
    assert mapped == []
    # every parameter owns its memory: writing one does not touch the file
    before = open(os.path.join(path, "model-00001-of-00003.safetensors"), "rb").read()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    assert open(os.path.join(path, "model-00001-of-00003.safetensors"), "rb").read() == before


def test_legacy_pickle_bin_loads_and_reports_its_cost(make_checkpoint):
    path = make_checkpoint("llama", "bin_legacy")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got, report = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, output_loading_info=True)
    assert report.checkpoint_format == "torch_legacy"
    assert any("legacy (non-zip) torch pickle" in n for n in report.notes)
    assert report.staging_bytes >= max(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".bin"))
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


def _rss_file_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_released_pages_leave_the_resident_set(tmp_path):
    path = tmp_path / "big.bin"
    torch.save({"w": torch.arange(16 * 1024 * 1024, dtype=torch.float32)}, path)  # 64 MiB
    t = torch.load(path, mmap=True, weights_only=True)["w"]
    before = _rss_file_kb()
    t.sum()  # fault every page in
    touched = _rss_file_kb()
    assert touched - before > 48 * 1024
    _release_pages(t)
    assert _rss_file_kb() - before < 4 * 1024
    assert float(t[-1]) == 16 * 1024 * 1024 - 1  # still readable: dropped pages come back from the file
    assert mmap.PAGESIZE > 0


def test_bin_report_counts_every_tensor_byte(make_checkpoint):
    path = make_checkpoint("llama", "bin")
    _, report = Causal.from_pretrained(path, output_loading_info=True)
    tensor_bytes = sum(p.numel() * p.element_size() for p in Causal.from_pretrained(path).state_dict().values())
    assert report.bytes_read - report.header_bytes == tensor_bytes
    assert len(report.files_read) == 3
