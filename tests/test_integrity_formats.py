"""Every checkpoint file is validated as strictly as its format: a damaged file is a named error, never wrong weights.

safetensors headers are checked as the safetensors library checks them (and transformers, through it, refuses the
same files); DCP metadata as DCP checks what it saves; ``.bin`` archives against their own zip directory, and read
with ``pread`` so a file cut under the load is an error, not a SIGBUS.
"""

import json
import os
import shutil
import struct

import pytest
import transformers

from lowmem_hf import CorruptCheckpointError
from lowmem_hf.auto import AUTO_CLASSES

Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]


# ---------------------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def sharded_llama(make_checkpoint, tmp_path):
    """A private copy of the sharded Llama the test may damage."""
    dst = tmp_path / "llama"
    shutil.copytree(make_checkpoint("llama", "sharded"), dst)
    return dst


def split_safetensors(path) -> tuple[dict, bytes]:
    """``(header, data section)`` of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors(path, header_text: str, data: bytes, *, length_delta: int = 0) -> None:
    """Write ``header_text`` (padded with spaces to 8 bytes, at least one) and ``data``; the length prefix is off by
    ``length_delta``."""
    raw = header_text.encode()
    raw += b" " * (8 + -len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) + length_delta) + raw + data)


def by_offset(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def one_byte_short_prefix(header, data):
    # the JSON is padded with spaces, so it still parses; every tensor would be read one byte early
    return json.dumps(header), data, -1


def moved_offsets(shift):
    def damage(header, data):
        # the last tensor that can move by `shift` and stay inside the file
        key = next(k for k in reversed(by_offset(header)) if header[k]["data_offsets"][1] + shift <= len(data))
        header[key]["data_offsets"] = [x + shift for x in header[key]["data_offsets"]]
        return json.dumps(header), data, 0

    return damage


def _same_size_pair(header):
    keys = by_offset(header)
    size = lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0]  # noqa: E731
    return next((a, b) for a in keys for b in keys if a != b and size(a) == size(b) and header[a]["shape"] == header[b]["shape"])


def same_offsets(header, data):
    # one tensor would become a copy of the other
    a, b = _same_size_pair(header)
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    return json.dumps(header), data, 0


def duplicate_key(header, data):
    # plain JSON keeps the last entry: key `a` would silently read `b`'s bytes
    a, b = _same_size_pair(header)
    text = json.dumps(header)
    return text[:-1] + f", {json.dumps(a)}: {json.dumps(header[b])}}}", data, 0


DAMAGES = {
    "length-prefix-one-byte-short": (one_byte_short_prefix, "data section covered"),
    **{f"offsets-moved-by-{n}": (moved_offsets(n), "contiguous offsets") for n in (1, 2, 4, 8, 64, 512, 4096)},
    "two-tensors-same-offsets": (same_offsets, "contiguous offsets"),
    "duplicate-json-key": (duplicate_key, "unique keys"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_invalid_safetensors_is_refused_naming_file_and_rule_as_transformers_refuses_it(sharded_llama, damage):
    shard = sharded_llama / "model-00003-of-00003.safetensors"
    make, rule = DAMAGES[damage]
    header, data = split_safetensors(shard)
    text, data, delta = make(header, data)
    write_safetensors(shard, text, data, length_delta=delta)

    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(sharded_llama)
    assert str(shard) in str(e.value) and f"breaks the safetensors rule {rule!r}: expected " in str(e.value), str(e.value)
    with pytest.raises(Exception):  # the safetensors library refuses it: transformers never loads it either
        transformers.AutoModelForCausalLM.from_pretrained(sharded_llama)


def test_offsets_moved_name_the_tensor_what_was_expected_and_found(sharded_llama):
    shard = sharded_llama / "model-00003-of-00003.safetensors"
    header, data = split_safetensors(shard)
    first, second = by_offset(header)[:2]
    begin, end = header[second]["data_offsets"]
    header[second]["data_offsets"] = [begin + 4, end + 4]
    write_safetensors(shard, json.dumps(header), data)
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(sharded_llama)
    assert f"{shard}: tensor {second!r} breaks the safetensors rule 'contiguous offsets': expected data_offsets beginning at {begin} " \
           f"(where {first!r} ends), found [{begin + 4}, {end + 4}): a gap of 4 bytes." in str(e.value)


def test_an_empty_header_over_data_is_refused_not_a_random_model(sharded_llama):
    for shard in sorted(sharded_llama.glob("*.safetensors")):
        _, data = split_safetensors(shard)
        write_safetensors(shard, "{}", data)
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(sharded_llama)
    assert "breaks the safetensors rule 'data section covered': expected no data (the header lists no tensor)" in str(e.value)
    with pytest.raises(Exception):
        transformers.AutoModelForCausalLM.from_pretrained(sharded_llama)


def test_a_byte_size_that_is_not_dtype_times_shape_is_refused(sharded_llama):
    shard = sharded_llama / "model-00003-of-00003.safetensors"
    header, data = split_safetensors(shard)
    key = by_offset(header)[0]
    header[key]["dtype"] = "F16"  # half the bytes the offsets span
    write_safetensors(shard, json.dumps(header), data)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor '{key}' breaks the safetensors rule 'byte size': expected \d+ bytes \(F16 x "):
        Causal.from_pretrained(sharded_llama)


@pytest.mark.parametrize(
    "text,rule",
    [
        ('{"__metadata__": {"format": 1}}', "__metadata__"),
        ('{"w": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}', "entry"),
        ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}', "entry"),
        ('{"w": {"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}}', "entry"),
        ('{"w": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "unique keys"),
        ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}} x', "header JSON"),
        ('{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": NaN}}', "header JSON"),
    ],
)
def test_header_entries_follow_the_format(tmp_path, text, rule):
    from lowmem_hf.formats.safetensors import read_header

    path = tmp_path / "w.safetensors"
    write_safetensors(path, text, b"\0" * 4)
    with pytest.raises(CorruptCheckpointError, match=f"breaks the safetensors rule {rule!r}"):
        read_header(str(path))


def test_what_the_library_accepts_loads(tmp_path):
    # whitespace before the object, unknown entry fields, zero-size tensors sharing an offset, a null __metadata__
    from lowmem_hf.formats.safetensors import read_header

    path = tmp_path / "w.safetensors"
    text = ('\n {"__metadata__": null, "e": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]}, '
            '"f": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]}, '
            '"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "note": "x"}}\t')
    write_safetensors(path, text, b"\0" * 4)
    infos, _ = read_header(str(path))
    assert sorted(infos) == ["e", "f", "w"]


def test_a_remote_header_read_by_ranges_is_validated_the_same(hf_hub, make_checkpoint, tmp_path):
    local = tmp_path / "repo"
    shutil.copytree(make_checkpoint("llama", "sharded"), local)
    shard = local / "model-00002-of-00003.safetensors"
    header, data = split_safetensors(shard)
    write_safetensors(shard, json.dumps(header), data, length_delta=-1)
    hf_hub.add_repo("org/llama", local)
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained("org/llama", fetch="ranges")
    assert "model-00002-of-00003.safetensors: the data section breaks the safetensors rule 'data section covered'" in str(e.value)
