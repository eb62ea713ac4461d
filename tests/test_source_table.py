"""Which byte source a load reads from, and how each source is read, are data: the fetch stage's table and the
``ReadPolicy`` each source decides for itself."""

import itertools

import pytest

from lowmem_hf.fetch.choose import SOURCES, checkpoint_kind, reads_local_files
from lowmem_hf.sources import ByteSource, ReadPolicy
from lowmem_hf.sources.exchange import CooperativeRanges
from lowmem_hf.sources.http import HttpRanges
from lowmem_hf.sources.local import GAP_BYTES, LocalFiles
from lowmem_hf.sources.objectstore import ObjectStoreRanges
from lowmem_hf.sources.schedule import DIRECT_READERS
from lowmem_hf.types import Checkpoint, CheckpointFormat, RemoteFile


def _checkpoint(
    *, fmt: str = CheckpointFormat.SAFETENSORS, repo_id: str | None = None, remote: bool = False, store: object = None,
) -> Checkpoint:
    files = {"model.safetensors": RemoteFile(filename="model.safetensors", url="http://hub/model.safetensors", size=8, etag=None)}
    return Checkpoint(
        name_or_path=repo_id or "/tmp/model", format=fmt, files=("model.safetensors",), tensors={}, index_metadata=None,
        header_bytes=0, repo_id=repo_id, remote=files if remote else {}, store=store,
    )


def test_the_table_names_a_source_for_every_checkpoint_fetch_mode_and_group():
    assert set(SOURCES) == set(itertools.product(("local", "hub", "hub-ranges", "store-ranges", "store-chunks"), ("files", "ranges"), (False, True)))


@pytest.mark.parametrize(
    "checkpoint,kind",
    [
        (_checkpoint(), "local"),
        (_checkpoint(fmt=CheckpointFormat.DCP), "local"),
        (_checkpoint(repo_id="org/model"), "hub"),  # every planned file already in the HF cache
        (_checkpoint(repo_id="org/model", fmt=CheckpointFormat.TORCH_ZIP), "hub"),
        (_checkpoint(repo_id="org/model", remote=True), "hub-ranges"),
        (_checkpoint(remote=True, store=object()), "store-ranges"),  # an object store's safetensors
        (_checkpoint(fmt=CheckpointFormat.DCP, remote=True, store=object()), "store-chunks"),  # its .distcp chunks
    ],
)
def test_where_the_checkpoint_is(checkpoint, kind):
    assert checkpoint_kind(checkpoint) == kind
    from_store = kind in ("store-ranges", "store-chunks")  # an object store has no cache to fill
    assert reads_local_files(checkpoint, "files") == (not from_store)
    assert reads_local_files(checkpoint, "ranges") == (kind != "hub-ranges" and not from_store)  # remote bytes come as ranges


def test_each_source_decides_how_it_is_read():
    assert ByteSource.policy == ReadPolicy(workers=None, band_reads=False, gap_bytes=0)
    assert HttpRanges.policy == ReadPolicy(workers=8, band_reads=True)  # a request per band of rows, many in flight
    assert ObjectStoreRanges.policy == ReadPolicy(workers=16, band_reads=True)  # object stores serve many requests at once
    # the readers have one request of a direct stretch each in flight
    assert CooperativeRanges.policy == ReadPolicy(workers=DIRECT_READERS) and DIRECT_READERS > 2
    warm, cold = LocalFiles.for_load({}, cold=False), LocalFiles.for_load({}, cold=True)
    assert warm.policy == ReadPolicy(gap_bytes=GAP_BYTES)  # page-cache copies cost less than a syscall per row
    assert cold.policy == ReadPolicy()  # from a cold disk a gap is device reads for nothing
    assert LocalFiles(gap_bytes=123).policy.gap_bytes == 123
    for files in (warm, cold):
        files.close()
