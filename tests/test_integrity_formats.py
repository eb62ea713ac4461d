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
import torch
import transformers

from lowmem_hf import CorruptCheckpointError, HubConnectionError
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


# ---------------------------------------------------------------------------------------------------------
# DCP metadata
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def llama_dcp(tmp_path):
    """A one-process ``dcp.save`` of a tiny Llama (every tensor one chunk) and its config."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False))
    path = tmp_path / "dcp"
    dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    model.config.save_pretrained(path)
    return model, path


def rewrite_metadata(path, change) -> None:
    import pickle

    metadata = pickle.loads((path / ".metadata").read_bytes())
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


def move_chunk(metadata, key, offsets=None, sizes=None, storage=None):
    """Re-file ``key``'s only chunk at ``offsets``/``sizes`` (its storage entry follows it), or point it at ``storage``."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    entry = metadata.state_dict_metadata[key]
    (chunk,) = entry.chunks
    info = metadata.storage_data.pop(MetadataIndex(key, chunk.offsets))
    new = ChunkStorageMetadata(offsets=offsets or chunk.offsets, sizes=sizes or chunk.sizes)
    entry.chunks = [new]
    metadata.storage_data[MetadataIndex(key, new.offsets)] = storage or info
    return info


def test_dcp_chunk_outside_its_tensor_is_refused(llama_dcp):
    import torch

    _, path = llama_dcp
    key = "model.layers.0.mlp.up_proj.weight"  # [128, 64]
    rewrite_metadata(path, lambda m: move_chunk(m, key, offsets=torch.Size([1, 0])))
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(path)
    assert f"{path / '.metadata'}: {key!r} (chunk at [1, 0]) breaks the DCP rule 'chunk inside its tensor': expected a box inside " \
           "the tensor's shape [128, 64], found offsets [1, 0], sizes [128, 64]." in str(e.value)


def test_dcp_overlapping_chunks_are_refused(llama_dcp):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    _, path = llama_dcp
    key = "model.layers.0.mlp.up_proj.weight"

    def overlap(metadata):
        entry = metadata.state_dict_metadata[key]
        (whole,) = entry.chunks
        half = ChunkStorageMetadata(offsets=torch.Size([64, 0]), sizes=torch.Size([64, 64]))
        entry.chunks = [whole, half]
        metadata.storage_data[MetadataIndex(key, half.offsets)] = metadata.storage_data[MetadataIndex(key, whole.offsets)]

    rewrite_metadata(path, overlap)
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(path)
    assert f"{key!r} breaks the DCP rule 'chunks do not overlap': expected chunks that share no element, found chunk at [0, 0] " \
           "(sizes [128, 64]) overlapping chunk at [64, 0] (sizes [64, 64])" in str(e.value)


def test_dcp_byte_range_outside_its_file_is_refused(llama_dcp):
    import dataclasses

    _, path = llama_dcp
    key = "model.norm.weight"

    def before_the_file(metadata):
        stored = move_chunk(metadata, key)
        move_chunk(metadata, key, storage=dataclasses.replace(stored, offset=-256))

    rewrite_metadata(path, before_the_file)
    with pytest.raises(CorruptCheckpointError, match=rf"{key!r} \(chunk at \[0\]\) breaks the DCP rule 'byte range inside its file'"):
        Causal.from_pretrained(path)


def test_dcp_chunk_reading_another_chunks_bytes_is_refused(llama_dcp):
    # two same-shaped tensors: pointing one at the other's bytes would load a copy of the other, silently
    _, path = llama_dcp
    src, dst = "model.layers.0.input_layernorm.weight", "model.layers.1.input_layernorm.weight"

    def alias(metadata):
        from torch.distributed.checkpoint.metadata import MetadataIndex

        (chunk,) = metadata.state_dict_metadata[src].chunks
        move_chunk(metadata, dst, storage=metadata.storage_data[MetadataIndex(src, chunk.offsets)])

    rewrite_metadata(path, alias)
    with pytest.raises(CorruptCheckpointError, match="breaks the DCP rule 'byte ranges do not overlap'") as e:
        Causal.from_pretrained(path)
    assert src in str(e.value) and dst in str(e.value)


def test_dcp_tensor_not_saved_whole_is_refused_before_any_read(llama_dcp):
    import torch

    _, path = llama_dcp
    key = "model.layers.1.mlp.down_proj.weight"  # [64, 128]: keep only its first 32 rows
    rewrite_metadata(path, lambda m: move_chunk(m, key, sizes=torch.Size([32, 128])))
    with pytest.raises(CorruptCheckpointError, match=rf"{key!r} breaks the DCP rule 'chunks cover what is read': expected stored "
                                                      r"chunks holding the 8192 elements this rank reads .*found 4096 stored"):
        Causal.from_pretrained(path)


def test_dcp_checks_do_not_refuse_a_sharded_save():
    # uneven shards of a tensor, one per rank, and an empty one: DCP's own layout passes
    import torch
    from lowmem_hf.formats.dcp import StoredChunk, check_chunks

    def chunk(offsets, sizes):
        return StoredChunk("f", tuple(offsets), tuple(sizes), torch.float32, 0, 1, raw=True)

    check_chunks("w", (5, 4), (chunk([0, 0], [3, 4]), chunk([3, 0], [2, 4]), chunk([5, 0], [0, 4])), where="ckpt")
    check_chunks("w", (4, 6), (chunk([0, 0], [4, 3]), chunk([0, 3], [4, 3])), where="ckpt")
    with pytest.raises(CorruptCheckpointError, match="chunks do not overlap"):
        check_chunks("w", (4, 6), (chunk([0, 0], [4, 3]), chunk([2, 2], [2, 4])), where="ckpt")


# ---------------------------------------------------------------------------------------------------------
# .bin (torch.save zip archives)
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def bin_llama(make_checkpoint, tmp_path):
    """A private copy of the sharded ``.bin`` Llama the test may damage."""
    dst = tmp_path / "llama-bin"
    shutil.copytree(make_checkpoint("llama", "bin"), dst)
    return dst


def patch_central_directory(path, member_suffix: str, **fields) -> str:
    """Overwrite fields (``compressed``, ``uncompressed``: sizes; ``header_offset``) of the central directory entry
    of the member whose name ends with ``member_suffix``; returns its full name."""
    import zipfile

    raw = bytearray(path.read_bytes())
    pos = zipfile.ZipFile(path).start_dir
    offsets = {"compressed": 20, "uncompressed": 24, "header_offset": 42}
    while raw[pos : pos + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack_from("<HHH", raw, pos + 28)
        name = raw[pos + 46 : pos + 46 + n].decode()
        if name.endswith(member_suffix):
            for field, value in fields.items():
                struct.pack_into("<I", raw, pos + offsets[field], value)
            path.write_bytes(bytes(raw))
            return name
        pos += 46 + n + m + k
    raise AssertionError(f"no member {member_suffix}")


def test_zip_whose_central_directory_disagrees_with_a_member_size_is_refused(bin_llama):
    import zipfile

    shard = bin_llama / "pytorch_model-00002-of-00003.bin"
    info = next(i for i in zipfile.ZipFile(shard).infolist() if i.filename.endswith("/data/0"))
    name = patch_central_directory(shard, "/data/0", compressed=info.file_size - 8, uncompressed=info.file_size - 8)
    with pytest.raises(CorruptCheckpointError) as e:
        Causal.from_pretrained(bin_llama)
    assert f"{shard}: zip member {name!r} breaks the rule 'member sizes': expected a data descriptor at byte " in str(e.value)
    assert f"saying crc 0x{info.CRC:08x} and {info.file_size - 8} bytes (the central directory's)" in str(e.value)


def test_zip_whose_central_directory_points_between_members_is_refused(bin_llama):
    import zipfile

    shard = bin_llama / "pytorch_model-00001-of-00003.bin"
    info = next(i for i in zipfile.ZipFile(shard).infolist() if i.filename.endswith("/data/1"))
    name = patch_central_directory(shard, "/data/1", header_offset=info.header_offset + 64)
    with pytest.raises(CorruptCheckpointError, match=rf"zip member '{name}' breaks the rule 'local header': expected a local file header at byte"):
        Causal.from_pretrained(bin_llama)


def test_zip_member_smaller_than_its_storage_is_refused(tmp_path):
    # a consistent archive whose storage member holds fewer bytes than the pickle says: torch would read past it
    import io
    import zipfile

    import torch
    from lowmem_hf.formats.torch_pickle import read_header

    buf = io.BytesIO()
    torch.save({"w": torch.arange(8, dtype=torch.float32)}, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "w.bin"
    with zipfile.ZipFile(path, "w") as out:  # rewritten by Python's zipfile: no data descriptors, unaligned data
        for info in source.infolist():
            data = source.read(info)
            out.writestr(info.filename, data[:-4] if info.filename.endswith("/data/0") else data)
    with pytest.raises(CorruptCheckpointError, match=r"w.bin: zip member 'data/0' breaks the rule 'member sizes': expected 32 bytes \(what the pickle says "
                                                      r"storage '0' of 'w' holds\), found 28 bytes in the zip directory"):
        read_header(str(path), weights_only=True)


def test_big_endian_and_strided_tensors_load_exactly(tmp_path):
    # an archive with byteorder 'big' (values byte-swapped) and a transposed tensor: both read as their storage span
    import io
    import zipfile

    import torch
    from lowmem_hf.formats import StreamStats
    from lowmem_hf.formats.torch_pickle import TorchReader, read_header
    from lowmem_hf.types import ShardSpec

    torch.manual_seed(0)
    state = {"t": torch.randn(6, 4).t(), "w": torch.randn(5, 3), "e": torch.empty(0, 3)}
    buf = io.BytesIO()
    torch.save(state, buf)
    source = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    path = tmp_path / "big.bin"
    with zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:  # every storage here is float32
                data = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))
            out.writestr(info.filename, data)
    expected = torch.load(path, weights_only=True)
    assert torch.equal(expected["w"], state["w"])  # torch itself reads the archive as we wrote it

    infos, _, _ = read_header(str(path), weights_only=True)
    assert all(i.offset is None for i in infos.values())  # not raw native-order values
    for key, shard in [("t", None), ("w", None), ("w", ShardSpec("colwise", dim=0, start=1, stop=4, tp_rank=0, tp_size=2)), ("e", None)]:
        info = infos[key]
        dst = torch.empty(shard.local_shape(info.shape) if shard else info.shape, dtype=torch.float64)
        reader = TorchReader({str(path): 1}, 64, True, StreamStats())
        for job in reader.jobs(info, dst, shard):
            job()
        reader.done(info, dst.numel() * 4)
        want = expected[key] if shard is None else expected[key][shard.start : shard.stop]
        assert torch.equal(dst, want.double()), key


_MID_LOAD = r"""
import os, sys, torch
from lowmem_hf import CorruptCheckpointError, HubConnectionError
from lowmem_hf.auto import AUTO_CLASSES
from lowmem_hf.formats import torch_pickle

path, shard, how = sys.argv[1], sys.argv[2], sys.argv[3]
original, done = torch_pickle.TorchReader.jobs, []

def damage_after_planning(self, info, dst, spec=None):
    jobs = original(self, info, dst, spec)  # the shard is open (and, before, mapped) here
    if info.file.endswith(shard) and not done:
        done.append(1)
        if how == "truncate":
            os.truncate(info.file, 4096)
        else:  # torch.save over it: the same inode, truncated, then the new archive written
            state = torch.load(info.file, weights_only=True)
            torch.save({k: v + 1 for k, v in state.items()}, info.file)
    return jobs

torch_pickle.TorchReader.jobs = damage_after_planning
try:
    AUTO_CLASSES["LowMemAutoModelForCausalLM"].from_pretrained(path, chunk_bytes=4096)
except CorruptCheckpointError as e:
    print("NAMED:", e)
    sys.exit(0)
print("LOADED")
sys.exit(3)
"""


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
def test_bin_cut_or_rewritten_mid_load_is_a_named_error_not_a_sigbus(bin_llama, tmp_path, how):
    # run in a child: before, torch's mapping of the shard killed the process with SIGBUS (or read a mix of files)
    import subprocess
    import sys

    shard = "pytorch_model-00002-of-00003.bin"
    script = tmp_path / "mid_load.py"
    script.write_text(_MID_LOAD)
    proc = subprocess.run([sys.executable, str(script), str(bin_llama), shard, how], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])  # -7: SIGBUS
    message = proc.stdout
    assert "NAMED:" in message and shard in message, message
    if how == "truncate":
        assert "the file ended" in message or "was cut while it loaded" in message, message
    else:
        assert "changed while it loaded" in message or "the file ended" in message, message


def test_each_bin_shard_is_located_once_per_load(make_checkpoint, monkeypatch):
    # The fixture interleaves the keys over 3 shards: every layer reads from all three, back and forth. Each shard's
    # pickle is read once when planning and once when the reader opens it, however the reads interleave.
    import torch
    from lowmem_hf.formats import torch_pickle

    path = make_checkpoint("llama", "bin")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    calls, real = [], torch_pickle.unpickle_locations
    monkeypatch.setattr(torch_pickle, "unpickle_locations", lambda f, archive, *, name: calls.append(os.path.basename(name)) or real(f, archive, name=name))
    for read_ahead_bytes in (0, 10**9):
        calls.clear()
        got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, read_ahead_bytes=read_ahead_bytes)
        shards = sorted(f for f in os.listdir(path) if f.endswith(".bin"))
        assert sorted(calls) == sorted(shards * 2)
        for name, t in ref.state_dict().items():
            assert torch.equal(got.state_dict()[name], t), name


# ---------------------------------------------------------------------------------------------------------
# index files (found by the property suite, tests/test_integrity_properties.py)
# ---------------------------------------------------------------------------------------------------------
INDEXES = {"sharded": "model.safetensors.index.json", "bin": "pytorch_model.bin.index.json"}


@pytest.mark.parametrize("fmt", INDEXES)
@pytest.mark.parametrize("content, found", [
    (b'{"metadata": {}, "weight_map": {}}', "its weight_map is empty"),
    (b'{"metadata": "x", "weight_map": {"a": "b"}}', "its 'metadata' is 'x', not an object"),
    (b'\xff\xfe\x00{', "'utf-8' codec can't decode byte 0xff"),
], ids=["empty-weight-map", "metadata-not-an-object", "not-utf8"])
def test_an_index_that_is_not_one_is_named(make_checkpoint, tmp_path, fmt, content, found):
    # unchecked, each would escape raw: IndexError in resolve.py, ValueError from dict() in load.py, UnicodeDecodeError
    folder = tmp_path / fmt
    shutil.copytree(make_checkpoint("llama", fmt), folder)
    (folder / INDEXES[fmt]).write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=rf"{folder / INDEXES[fmt]} is not a valid index: expected JSON with a 'weight_map' object \({found}"):
        Causal.from_pretrained(folder)


@pytest.mark.parametrize("fmt", INDEXES)
def test_an_index_that_maps_tensors_to_a_shard_that_lacks_them_is_refused_not_reinitialized(make_checkpoint, tmp_path, fmt):
    # every entry pointed at shard 1: transformers loads shard 1 and re-initializes the rest with a warning
    folder = tmp_path / fmt
    shutil.copytree(make_checkpoint("llama", fmt), folder)
    index = json.loads((folder / INDEXES[fmt]).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = dict.fromkeys(index["weight_map"], first)
    (folder / INDEXES[fmt]).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match=rf"{folder / INDEXES[fmt]} maps \d+ tensor\(s\) to {first} that no shard stores: '"):
        Causal.from_pretrained(folder)


def test_a_file_cut_on_the_hub_mid_load_by_ranges_is_named(hf_hub, make_checkpoint, tmp_path):
    # the server's 416 for a range past the new end, unchecked, is a raw HfHubHTTPError
    from lowmem_hf import RemoteFileChangedError

    local = tmp_path / "repo"
    shutil.copytree(make_checkpoint("llama", "sharded"), local)
    hf_hub.add_repo("org/llama", local)
    shard = "model-00002-of-00003.safetensors"
    data = hf_hub.file_path("org/llama", shard).read_bytes()

    def after_first_body_read(record):  # the headers are read at bytes 0-7 and from byte 8; tensor bytes after them
        return record.method == "GET" and bool(record.range) and int(record.range.removeprefix("bytes=").split("-")[0]) > 8

    hf_hub.replace_file("org/llama", shard, data[:64], when=after_first_body_read)
    with pytest.raises(RemoteFileChangedError, match=rf"{shard}: the load was planned for {len(data)} bytes .*but the server now has 64 bytes \(416"):
        Causal.from_pretrained("org/llama", fetch="ranges", chunk_bytes=4096)


@pytest.mark.parametrize("status", [500, 503, 429])
def test_ranges_retry_a_server_error_and_load_intact(hf_hub, make_checkpoint, tmp_path, status):
    # unretried, the first 5xx of a range read is a raw HfHubHTTPError (the header reads and body reads alike)
    import torch

    local = tmp_path / "repo"
    shutil.copytree(make_checkpoint("llama", "sharded"), local)
    hf_hub.add_repo("org/llama", local)
    hf_hub.fail_next(status, 2, path="*.safetensors", methods=("GET",))
    got = Causal.from_pretrained("org/llama", fetch="ranges", chunk_bytes=4096)
    expected = transformers.AutoModelForCausalLM.from_pretrained(local)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name


@pytest.mark.parametrize("status, error, found", [
    (503, HubConnectionError, "after 5 attempts; the server answered 503 to the last one"),
    (404, None, "now answers 404 Not Found for it"),
])
def test_ranges_name_a_server_that_keeps_failing_or_lost_the_file(hf_hub, make_checkpoint, tmp_path, status, error, found):
    from lowmem_hf import RemoteFileChangedError

    local = tmp_path / "repo"
    shutil.copytree(make_checkpoint("llama", "sharded"), local)
    hf_hub.add_repo("org/llama", local)
    hf_hub.fail_next(status, None, path="model-00002-of-00003.safetensors", methods=("GET",))
    with pytest.raises(error or RemoteFileChangedError, match=rf"model-00002-of-00003.safetensors: .*{found}"):
        Causal.from_pretrained("org/llama", fetch="ranges", chunk_bytes=4096)


@pytest.mark.parametrize("fault", ["cut", 503])
def test_files_name_a_download_the_hub_never_delivers(hf_hub, make_checkpoint, tmp_path, fault):
    # unnamed, it is huggingface_hub's own httpx RemoteProtocolError (every body cut) or HfHubHTTPError (5xx on every
    # try), naming the URL at best
    local = tmp_path / "repo"
    shutil.copytree(make_checkpoint("llama", "sharded"), local)
    hf_hub.add_repo("org/llama", local)
    shard = "model-00002-of-00003.safetensors"
    if fault == "cut":
        hf_hub.cut_next(4096, None, path=shard)
        found = "the connection kept dropping"
    else:
        hf_hub.fail_next(fault, None, path=shard, methods=("GET",), ranged=False)  # the header reads pass
        found = "the server answered 503"
    with pytest.raises(HubConnectionError, match=rf"{shard} \(repo 'org/llama', revision [0-9a-f]{{40}}\): downloading it failed 5 times; the last time {found}"):
        Causal.from_pretrained("org/llama", fetch="files")
    hf_hub.clear_faults()
    got = Causal.from_pretrained("org/llama", fetch="files")  # nothing half-downloaded is taken for the file
    expected = transformers.AutoModelForCausalLM.from_pretrained(local)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name


def test_a_head_answered_503_is_retried_and_one_that_keeps_failing_is_named(hf_hub, make_checkpoint, tmp_path):
    # unretried, the first 503 of the HEAD that reads a shard's size and etag is a raw HfHubHTTPError (huggingface_hub
    # retries neither it nor a download whose body stayed short)
    local = tmp_path / "repo"
    shutil.copytree(make_checkpoint("llama", "sharded"), local)
    hf_hub.add_repo("org/llama", local)
    shard = "model-00002-of-00003.safetensors"
    hf_hub.fail_next(503, 2, path=shard, methods=("HEAD",))
    got = Causal.from_pretrained("org/llama", fetch="ranges")
    expected = transformers.AutoModelForCausalLM.from_pretrained(local)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name
    hf_hub.fail_next(503, None, path=shard, methods=("HEAD",))
    with pytest.raises(HubConnectionError, match=rf"{shard} \(repo 'org/llama', revision [0-9a-f]{{40}}\): reading its size and etag failed 5 times; the last time the server answered 503"):
        Causal.from_pretrained("org/llama", fetch="ranges")
