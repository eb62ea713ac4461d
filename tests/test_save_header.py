"""The safetensors header a save writes (``formats.safetensors.encode_header``): it parses back, through the same
strict parser loads use, to the tensors it was made for, and it is byte for byte what the safetensors library
writes for the same tensors in the same order."""

from __future__ import annotations

import struct

import pytest
import torch
import transformers
from safetensors.torch import load_file, save

import lowmem_hf

from lowmem_hf.formats.safetensors import DTYPES, TAGS, encode_header, parse_header

TENSORS = {
    "model.embed_tokens.weight": torch.ones(5, 3, dtype=torch.bfloat16),
    "model.norm.weight": torch.ones(3),
    "lm_head.bias": torch.ones(7, dtype=torch.float16),
    "positions": torch.arange(4),
    "mask": torch.ones(2, 2, dtype=torch.bool),
    "empty": torch.ones(0, 3, dtype=torch.float64),
    "scalar": torch.tensor(1, dtype=torch.int8),
}


def test_the_write_table_is_the_read_table_read_the_other_way():
    assert {tag: dtype for dtype, tag in TAGS.items()} == DTYPES


def test_an_encoded_header_parses_back_to_the_same_tensors():
    items = [(name, t.dtype, tuple(t.shape)) for name, t in TENSORS.items()]
    raw = encode_header(items, {"format": "pt"})
    (length,) = struct.unpack("<Q", raw[:8])
    assert length == len(raw) - 8 and length % 8 == 0
    data = sum(t.numel() * t.element_size() for t in TENSORS.values())
    infos = parse_header(raw[8:], header_len=length, file_size=len(raw) + data, name="f")
    assert list(infos) == list(TENSORS)
    offset = len(raw)
    for name, t in TENSORS.items():
        assert (infos[name].dtype, infos[name].shape, infos[name].offset) == (t.dtype, tuple(t.shape), offset)
        offset += t.numel() * t.element_size()


def test_the_header_is_byte_identical_to_what_the_safetensors_library_writes():
    """Given the order the library chose (it sorts by dtype, then name), the two headers are the same bytes, and so
    is the whole file once the tensors follow in that order. (Metadata of several keys is written in the caller's
    order; the library orders those keys itself.)"""
    metadata = {"format": "pt"}
    written = save(TENSORS, metadata=metadata)
    (length,) = struct.unpack("<Q", written[:8])
    infos = parse_header(written[8 : 8 + length], header_len=length, file_size=len(written), name="f")
    order = sorted(infos, key=lambda name: infos[name].offset)
    header = encode_header([(name, TENSORS[name].dtype, tuple(TENSORS[name].shape)) for name in order], metadata)
    assert header == written[: 8 + length]
    body = b"".join(TENSORS[name].contiguous().view(torch.uint8).numpy().tobytes() for name in order)
    assert header + body == written


@pytest.mark.parametrize("layout", [{}, {"distributed_checkpoint": True}], ids=["gathered", "rank files"])
@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.complex64], ids=str)
def test_a_save_writes_every_dtype_the_format_stores_and_a_load_reads(tmp_path, dtype, layout):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16,
    ))
    model.register_buffer("extra", (torch.arange(6).reshape(2, 3) + 1).to(dtype))
    lowmem_hf.save_pretrained(model, tmp_path, **layout)
    [name] = [n for n in tmp_path.iterdir() if n.suffix == ".safetensors"]
    assert torch.equal(load_file(name)["extra"], model.extra)
