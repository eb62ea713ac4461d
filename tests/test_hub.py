"""Hub repos through huggingface_hub against the loopback fake Hub: one pinned commit, only the planned bytes."""

import json
import os
import socket
import struct
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from huggingface_hub import constants
from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

import lowmem_hf
from hub_server import use_hub
from lowmem_hf import CheckpointNotFoundError
from lowmem_hf.errors import RemoteFileChangedError

Causal = lowmem_hf.LowMemAutoModelForCausalLM


def weight_files(folder):
    return [f for f in os.listdir(folder) if f.endswith((".safetensors", ".bin"))]


def cached_weight_files(hf_home):
    found = []
    for root, _, files in os.walk(os.path.join(hf_home, "hub")):
        found += [f for f in files if f.endswith((".safetensors", ".bin")) or ".incomplete" in f]
    return found


def assert_same(got, expected):
    a, b = got.state_dict(), expected.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fetch", ["files", "ranges"])
@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_hub_load_equals_local_load(hf_hub, make_checkpoint, tmp_path, fmt, fetch):
    local = make_checkpoint("llama", fmt)
    sha = hf_hub.add_repo("org/llama", local)
    expected = Causal.from_pretrained(local, torch_dtype=torch.bfloat16)
    got, report = Causal.from_pretrained("org/llama", torch_dtype=torch.bfloat16, fetch=fetch, output_loading_info=True)
    assert_same(got, expected)
    assert report.commit == sha
    # every weight request asked for the pinned sha, never for a branch name
    weight_requests = [r for r in hf_hub.requests if r.filename and r.filename.endswith((".safetensors", ".bin"))]
    assert weight_requests and {r.revision for r in weight_requests} == {sha}
    cached = cached_weight_files(tmp_path / "hf_home")
    if fetch == "ranges" and fmt == "sharded":
        assert cached == []  # nothing written to disk: ranges went straight into the tensors
        tensor_bytes = sum(hf_hub.bytes_for("org/llama", f) for f in weight_files(local))
        assert tensor_bytes == report.bytes_read - os.path.getsize(os.path.join(local, "model.safetensors.index.json"))
    else:
        assert sorted(cached) == sorted(weight_files(local))


def test_revision_is_resolved_once_to_a_commit(hf_hub, make_checkpoint):
    main = hf_hub.add_repo("org/m", make_checkpoint("llama", "sharded"))
    dev = hf_hub.add_revision("org/m", "dev", make_checkpoint("qwen2_tied", "sharded"))
    got, report = Causal.from_pretrained("org/m", revision="dev", fetch="ranges", output_loading_info=True)
    assert report.commit == dev != main and type(got).__name__ == "Qwen2ForCausalLM"
    by_branch = [r for r in hf_hub.requests if r.revision == "dev"]
    assert len(by_branch) <= 2 and all(r.filename in (None, "config.json") for r in by_branch), by_branch


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "converted"])
@pytest.mark.parametrize("fetch", ["files", "ranges"])
def test_cut_connection_still_loads_identical_weights(hf_hub, make_checkpoint, fetch, dtype):
    local = make_checkpoint("llama", "sharded")  # fp32: "converted" ranges are streamed into the tensors
    hf_hub.add_repo("org/llama", local)
    # the first 3 matching GETs are the planning reads of 3 headers (length and JSON in one read, cut where longer
    # than the cut and resumed), then 2 more
    hf_hub.cut_next(1000, count=3 + 2, path="*.safetensors")
    got, report = Causal.from_pretrained("org/llama", fetch=fetch, torch_dtype=dtype, output_loading_info=True)
    assert_same(got, Causal.from_pretrained(local, torch_dtype=dtype))
    # the 4th and 5th GETs are cut if longer than the cut; which reads they are depends on the order concurrent
    # reads reach the server (a small norm weight may be one of them), so at least one body was really cut
    assert 1 <= sum(r.cut for r in hf_hub.requests) <= 5


def test_a_streamed_range_comes_in_whole_pieces_once_each_across_cut_connections(hf_hub, tmp_path):
    from lowmem_hf.sources import STREAM_PIECE_BYTES
    from lowmem_hf.sources.http import HttpRanges
    from lowmem_hf.types import RemoteFile

    local, data = tmp_path / "repo", os.urandom(5 * STREAM_PIECE_BYTES // 2)  # a range read needs no valid header
    local.mkdir()
    (local / "model.safetensors").write_bytes(data)
    sha = hf_hub.add_repo("org/llama", local)
    url = f"{hf_hub.url}/org/llama/resolve/{sha}/model.safetensors"
    ranges = HttpRanges({"model.safetensors": RemoteFile("model.safetensors", url, len(data), None)})
    start, nbytes = 1000, len(data) - 2000
    assert ranges.streams("model.safetensors", start, nbytes) and nbytes > 2 * STREAM_PIECE_BYTES
    hf_hub.cut_next(STREAM_PIECE_BYTES // 3 + 5, count=3)  # cut inside a piece: it is resumed, not handed over twice
    pieces = []
    ranges.read_streamed("model.safetensors", start, nbytes, lambda piece, at: pieces.append((at, bytes(piece))))
    assert [at for at, _ in pieces] == list(range(0, nbytes, STREAM_PIECE_BYTES))  # in order, once each
    assert all(len(p) == STREAM_PIECE_BYTES for _, p in pieces[:-1])  # whole elements of any dtype but the last
    assert b"".join(p for _, p in pieces) == data[start : start + nbytes]
    assert ranges.requests == 4 and sum(r.cut for r in hf_hub.requests) == 3  # three cut bodies, each resumed


def test_remote_file_that_changed_size_is_an_error_naming_it(hf_hub, make_checkpoint, tmp_path):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    name = "model-00002-of-00003.safetensors"
    grown = open(os.path.join(local, name), "rb").read() + b"\0" * 100
    hf_hub.replace_file("org/llama", name, grown, when="head")  # after it was planned
    with pytest.raises(RemoteFileChangedError) as e:
        Causal.from_pretrained("org/llama", fetch="ranges")
    size = os.path.getsize(os.path.join(local, name))
    assert name in str(e.value) and str(size) in str(e.value) and str(size + 100) in str(e.value)


def test_changed_file_leaves_no_corrupt_blob_in_the_cache(hf_hub, make_checkpoint, tmp_path):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    name = "model-00002-of-00003.safetensors"
    grown = open(os.path.join(local, name), "rb").read() + b"\0" * 100
    hf_hub.replace_file("org/llama", name, grown, when="head")  # changed after it was planned
    with pytest.raises(RemoteFileChangedError) as e:
        Causal.from_pretrained("org/llama", fetch="files")
    size = os.path.getsize(os.path.join(local, name))
    assert name in str(e.value) and f"planned for {size} bytes" in str(e.value) and str(size + 100) in str(e.value)
    blobs = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "hf_home" / "hub") for f in fs if "blobs" in r]
    assert all(os.path.getsize(b) != size + 100 for b in blobs)
    assert name not in cached_weight_files(tmp_path / "hf_home")


def test_offline_after_one_online_load_makes_no_request(hf_hub, make_checkpoint, monkeypatch):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    Causal.from_pretrained("org/llama", fetch="files")
    hf_hub.reset_counters()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    got = Causal.from_pretrained("org/llama")
    assert_same(got, Causal.from_pretrained(local))
    assert hf_hub.requests == []
    # a repo never fetched: huggingface_hub's own offline error, not a traceback from deep inside
    hf_hub.add_repo("org/other", local)
    with pytest.raises((LocalEntryNotFoundError, OfflineModeIsEnabled)):
        Causal.from_pretrained("org/other")
    assert hf_hub.requests == []


def test_planning_reads_each_shard_header_with_one_request(hf_hub, make_checkpoint):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    lowmem_hf.prepare(lowmem_hf.make_request(transformers.AutoModelForCausalLM, "org/llama", fetch="ranges"))  # planning
    for name in weight_files(local):
        gets = [r.range for r in hf_hub.requests if r.filename == name and r.method == "GET"]
        assert len(gets) == 1 and gets[0].startswith("bytes=0-"), (name, gets)  # length prefix and header at once


@pytest.mark.parametrize(
    "repo,kwargs,words",
    [
        ("org/nope", {}, ["'org/nope'", "does not exist"]),
        ("org/llama", {"revision": "v9"}, ["'org/llama'", "'v9'"]),
        ("org/llama", {"variant": "fp8"}, ["'org/llama'", "model.fp8.safetensors"]),
    ],
)
def test_missing_repo_revision_or_file_is_named(hf_hub, make_checkpoint, repo, kwargs, words):
    hf_hub.add_repo("org/llama", make_checkpoint("llama", "sharded"))
    with pytest.raises(CheckpointNotFoundError) as e:
        Causal.from_pretrained(repo, **kwargs)
    for w in words:
        assert w in str(e.value)


def test_one_process_fetches_dim1_slices_as_row_bands(hf_hub, make_checkpoint):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    hf_hub.reset_counters()
    got, report = Causal.from_pretrained("org/llama", fetch="ranges", tp_rank=1, tp_size=2, output_loading_info=True)
    assert_same(got, Causal.from_pretrained(local, tp_rank=1, tp_size=2))
    rowwise = report.shards["model.layers.0.self_attn.o_proj.weight"]
    assert rowwise.dim == 1
    rows = sum(got.get_parameter(n).shape[0] for n, s in report.shards.items() if s.dim == 1)
    gets = [q for q in hf_hub.requests if q.method == "GET" and q.filename.endswith(".safetensors")]
    assert len(gets) < rows // 4  # bands, not one request per row
    note = next(n for n in report.notes if "row bands" in n)
    extra = int(note.split(" bytes beyond")[0].rsplit(" ", 1)[1])
    assert extra > 0 and report.bytes_fetched == report.bytes_read - report.header_bytes + extra


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tp_worker(rank, world, port, url, homes, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        with use_hub(url, homes[rank]):  # a separate cache per rank: two "nodes"
            model, report = Causal.from_pretrained("org/tp", tp_plan="auto", fetch="ranges", output_loading_info=True)
            local = sum(
                (p.data.to_local() if hasattr(p.data, "to_local") else p.data).numel() * 4
                for n, p in model.named_parameters() if n in report.dtype_decisions
            )
            torch.save({"bytes_read": report.bytes_read, "header_bytes": report.header_bytes, "local": local,
                        "cached": cached_weight_files(homes[rank]), "fetched": report.bytes_fetched,
                        "received": report.bytes_received, "requests": report.requests}, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_ranges_transfer_about_one_checkpoint(hf_hub, tmp_path):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tp", max_shard_size="1MB")
    hf_hub.add_repo("org/tp", tmp_path / "tp")
    hf_hub.reset_counters()
    homes = [str(tmp_path / f"node{r}") for r in range(2)]
    mp.spawn(_tp_worker, args=(2, _free_port(), hf_hub.url, homes, str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    checkpoint = sum(os.path.getsize(tmp_path / "tp" / f) for f in weight_files(tmp_path / "tp"))
    transferred = sum(hf_hub.bytes_for("org/tp", f) for f in weight_files(tmp_path / "tp"))
    assert transferred <= 1.1 * checkpoint, (transferred, checkpoint)
    for r in ranks:
        assert r["bytes_read"] - r["header_bytes"] == r["local"]  # its slices + replicated tensors, nothing else
        assert r["cached"] == []
    index = os.path.getsize(tmp_path / "tp" / "model.safetensors.index.json")
    # the ranks fetch together (exchange.py): each tensor byte once, plus every rank's header reads
    assert transferred == sum(r["fetched"] + r["header_bytes"] - index for r in ranks)
    shards = [tmp_path / "tp" / f for f in weight_files(tmp_path / "tp")]
    headers = sum(8 + struct.unpack("<Q", shard.read_bytes()[:8])[0] for shard in shards)
    assert sum(r["fetched"] for r in ranks) == checkpoint - headers  # every tensor byte once, by one rank
    assert all(r["received"] > 0 for r in ranks)


def _moved_branch_worker(rank, world, port, url, homes, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        if rank == 1:  # starts once rank 0 has config.json, so it asks for `main` after the branch moved
            deadline = time.monotonic() + 60  # rank 0 failed before that: its error ends the test, not a hang here
            while not any(f == "config.json" for _, _, files in os.walk(homes[0]) for f in files):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
        with use_hub(url, homes[rank]):
            model, report = Causal.from_pretrained("org/moving", fetch="ranges", output_loading_info=True)
        torch.save({"commit": report.commit, "eps": model.config.rms_norm_eps}, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_loads_rank_0s_commit_when_the_branch_moves_between_their_requests(hf_hub, make_checkpoint, tmp_path):
    before = hf_hub.add_repo("org/moving", make_checkpoint("llama", "sharded"))
    moved = json.loads(hf_hub.file_path("org/moving", "config.json").read_text())
    moved["rms_norm_eps"] = 0.125
    hf_hub.replace_file("org/moving", "config.json", json.dumps(moved), new_commit=True,
                        when=lambda r: r.method == "GET" and r.filename == "config.json")
    homes = [str(tmp_path / f"node{r}") for r in range(2)]
    mp.spawn(_moved_branch_worker, args=(2, _free_port(), hf_hub.url, homes, str(tmp_path)), nprocs=2, join=True)
    after = hf_hub.commit_sha("org/moving")
    assert after != before
    assert any(r.filename == "config.json" and r.commit == after for r in hf_hub.requests)  # rank 1 saw the move
    for rank in range(2):
        got = torch.load(tmp_path / f"{rank}.pt")
        assert got["commit"] == before and got["eps"] != 0.125, (rank, got)


def test_files_mode_downloads_only_the_files_the_plan_touches(hf_hub, make_checkpoint, tmp_path):
    # lm_head alone in its own shard: the base model (AutoModel) needs nothing from it
    import json as _json

    from safetensors.torch import load_file, save_file

    src = make_checkpoint("llama", "safetensors")
    repo = tmp_path / "split"
    repo.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            (repo / name).write_bytes(open(os.path.join(src, name), "rb").read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    head = {"lm_head.weight": tensors.pop("lm_head.weight")}
    save_file(tensors, repo / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(head, repo / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors} | {"lm_head.weight": "model-00002-of-00002.safetensors"}
    (repo / "model.safetensors.index.json").write_text(_json.dumps({"metadata": {}, "weight_map": weight_map}))
    hf_hub.add_repo("org/split", repo)

    got, report = lowmem_hf.LowMemAutoModel.from_pretrained("org/split", fetch="files", output_loading_info=True)
    assert report["unexpected_keys"] == {"lm_head.weight"}
    assert cached_weight_files(tmp_path / "hf_home") == ["model-00001-of-00002.safetensors"]
    head_bytes = os.path.getsize(repo / "model-00002-of-00002.safetensors")
    assert hf_hub.bytes_for("org/split", "model-00002-of-00002.safetensors") < head_bytes // 10  # its header only
    assert_same(got, lowmem_hf.LowMemAutoModel.from_pretrained(repo))


@pytest.mark.parametrize("fetch", ["files", "ranges"])
def test_auto_dtype_without_config_dtype_comes_from_the_weights(hf_hub, make_checkpoint, tmp_path, fetch):
    import json as _json

    src = make_checkpoint("llama", "sharded", dtype=torch.bfloat16)
    repo = tmp_path / "nodtype"
    repo.mkdir()
    for name in os.listdir(src):
        (repo / name).write_bytes(open(os.path.join(src, name), "rb").read())
    config = _json.loads((repo / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (repo / "config.json").write_text(_json.dumps(config))
    hf_hub.add_repo("org/nodtype", repo)
    got, report = Causal.from_pretrained("org/nodtype", fetch=fetch, output_loading_info=True)
    assert report.dtype == torch.bfloat16 == got.lm_head.weight.dtype
    assert_same(got, Causal.from_pretrained(repo))
    if fetch == "files":  # again, now entirely from the cache: transformers reads the first cached file
        again, report = Causal.from_pretrained("org/nodtype", output_loading_info=True)
        assert report.dtype == torch.bfloat16
        assert_same(again, got)


def test_mmap_from_the_hub_maps_cached_files_and_refuses_ranges(hf_hub, make_checkpoint):
    local = make_checkpoint("llama", "sharded")
    hf_hub.add_repo("org/llama", local)
    with pytest.raises(ValueError, match=r"but fetch='ranges' reads the Hub files into memory, not into local files\. Pass fetch='files'"):
        Causal.from_pretrained("org/llama", fetch="ranges", mmap=True)
    model = Causal.from_pretrained("org/llama", mmap=True)  # whole files into the HF cache, then views of them
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model.lowmem_report.mapped_bytes == params
    assert_same(model, Causal.from_pretrained(local))
