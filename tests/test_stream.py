"""The readers: chunked conversion is exact at any chunk size, .bin streams shard by shard, nothing stays mapped."""

import mmap
import os
import shutil
import threading
import time

import pytest
import torch
import transformers

from lowmem_hf import load as load_mod
from lowmem_hf.auto import AUTO_CLASSES
from lowmem_hf.errors import CorruptCheckpointError
from lowmem_hf.formats import StreamStats
from lowmem_hf.formats.base import byte_view
from lowmem_hf.formats.torch_pickle import TorchReader
from lowmem_hf.runs import chunk_spans
from lowmem_hf.sources.local import GAP_BYTES, LocalFiles, cached_fraction
from lowmem_hf.sources.local import release_pages as _release_pages
from lowmem_hf.stream import COLD_CHUNK_BYTES, COLD_STAGING_SHARE, COLD_WORKERS, DEFAULT_WORKERS
from lowmem_hf.types import ShardSpec, TensorInfo

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
    # Local safetensors: preadv into a staging chunk, converted by copy_; .bin from torch's mapping, chunk by chunk.
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


@pytest.mark.parametrize("read_ahead_bytes", [0, 10**9], ids=["one_submodule", "everything"])
def test_bin_shards_mixing_zip_and_legacy_pickles_load_exactly(make_checkpoint, tmp_path, read_ahead_bytes):
    # One legacy pickle among zip shards, keys interleaved: whether a tensor's pages may be dropped after its copy
    # is its own shard's business (dropping those of a legacy shard's heap memory destroyed it: the process crashed).
    path = shutil.copytree(make_checkpoint("llama", "bin"), tmp_path / "llama")
    first = sorted(f for f in os.listdir(path) if f.endswith(".bin"))[0]
    state = torch.load(os.path.join(path, first), weights_only=True)
    torch.save(state, os.path.join(path, first), _use_new_zipfile_serialization=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, chunk_bytes=1000, read_ahead_bytes=read_ahead_bytes)
    assert any(first in n and "legacy (non-zip) torch pickle" in n for n in got.lowmem_report.notes)
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_populate_faults_in_the_untouched_pages_of_a_destination_and_changes_no_byte():
    # What a same-dtype read does before its preadv: the fresh destination's pages are faulted in with one madvise
    # instead of one by one inside the kernel's copy. A page not wholly inside the view is left alone.
    mib = 1024 * 1024
    t = torch.empty(64 * mib, dtype=torch.uint8)  # over malloc's mmap threshold: fresh, untouched pages
    t[: 8 * mib].fill_(7)
    before = _status_kb("RssAnon")
    files = LocalFiles()
    files.populate([byte_view(t)[100 : 64 * mib - 100]])
    grown = _status_kb("RssAnon") - before
    files.close()
    assert 54 * 1024 <= grown <= 57 * 1024, grown  # the 56 MiB not touched yet, less the two edge pages
    assert bool((t[: 8 * mib] == 7).all())
    files.populate([memoryview(b"read-only" * 100_000)])  # a buffer that cannot be written: nothing to do, no error


def test_released_pages_leave_the_resident_set(tmp_path):
    path = tmp_path / "big.bin"
    torch.save({"w": torch.arange(16 * 1024 * 1024, dtype=torch.float32)}, path)  # 64 MiB
    t = torch.load(path, mmap=True, weights_only=True)["w"]
    before = _status_kb("RssFile")
    t.sum()  # fault every page in
    touched = _status_kb("RssFile")
    assert touched - before > 48 * 1024
    _release_pages(t)
    assert _status_kb("RssFile") - before < 4 * 1024
    assert float(t[-1]) == 16 * 1024 * 1024 - 1  # still readable: dropped pages come back from the file
    assert mmap.PAGESIZE > 0


def test_bin_report_counts_every_tensor_byte(make_checkpoint):
    path = make_checkpoint("llama", "bin")
    _, report = Causal.from_pretrained(path, output_loading_info=True)
    tensor_bytes = sum(p.numel() * p.element_size() for p in Causal.from_pretrained(path).state_dict().values())
    assert report.bytes_read - report.header_bytes == tensor_bytes
    assert len(report.files_read) == 3


def test_the_report_says_where_the_wall_time_went_stage_by_stage(make_checkpoint):
    _, report = Causal.from_pretrained(make_checkpoint("llama", "sharded"), output_loading_info=True)
    assert list(report.stage_seconds) == list(load_mod.STAGES) == ["prepare", "fetch", "stream", "finish"]
    assert all(seconds >= 0 for seconds in report.stage_seconds.values())
    # the stages are consecutive from prepare's start; the report itself is made after the last one
    assert sum(report.stage_seconds.values()) <= report.wall_seconds < sum(report.stage_seconds.values()) + 0.5


@pytest.mark.parametrize("read_ahead_bytes", [0, 1, 10**9], ids=["one_submodule", "tiny_budget", "everything"])
@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_read_ahead_is_exact_at_any_budget(make_checkpoint, fmt, read_ahead_bytes):
    path = make_checkpoint("llama", fmt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, chunk_bytes=1000, read_ahead_bytes=read_ahead_bytes)
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


def test_a_submodule_the_source_refuses_to_read_ahead_into_waits_for_every_earlier_read(make_checkpoint, monkeypatch):
    # the cooperative fetch refuses a submodule of a later wave: starting it drops the wave earlier reads still read
    path = make_checkpoint("llama", "sharded")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    refused = {"model.layers.1", "lm_head"}
    lock, pending, started = threading.Lock(), [0], []  # pending: reads submitted and not finished

    def arrange(self, name, jobs):  # the stream hands each submodule's reads over here as it submits them
        def counted(job):
            def run():
                try:
                    time.sleep(0.001)  # so that a submodule's reads are still pending when the next is submitted
                    job()
                finally:
                    with lock:
                        pending[0] -= 1
            return run

        with lock:
            pending[0] += len(jobs)
        return [counted(job) for job in jobs]

    monkeypatch.setattr(LocalFiles, "arrange", arrange)
    monkeypatch.setattr(LocalFiles, "may_read_ahead", lambda self, name: name not in refused)
    monkeypatch.setattr(LocalFiles, "before_submodule", lambda self, name: started.append((name, pending[0])))
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, chunk_bytes=1000, read_ahead_bytes=10**9)
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name
    assert refused <= {name for name, _ in started}
    assert all(earlier == 0 for name, earlier in started if name in refused), started
    # the others were started while earlier reads were pending: read-ahead is refused only where the source says
    assert any(earlier > 0 for name, earlier in started[1:] if name not in refused), started


def _file_backed(path: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if path in line]


def test_mmap_leaves_same_dtype_tensors_as_copy_on_write_views(make_checkpoint):
    path = make_checkpoint("llama", "sharded")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = Causal.from_pretrained(path, torch_dtype=torch.float32, mmap=True)
    for name, t in ref.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    report = model.lowmem_report
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert report.mapped_bytes == params  # every parameter is a whole stored tensor of the stored dtype
    assert report.bytes_read == report.header_bytes  # nothing was copied
    assert _file_backed(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    before = [open(os.path.join(path, f), "rb").read() for f in files]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)  # the first write copies the page: the file never changes
    assert [open(os.path.join(path, f), "rb").read() for f in files] == before
    again = Causal.from_pretrained(path, torch_dtype=torch.float32)
    assert torch.equal(again.lm_head.weight, ref.lm_head.weight)


@pytest.mark.parametrize(
    "fmt,kwargs,expected",
    [
        ("sharded", {"torch_dtype": torch.bfloat16}, r"21 tensor\(s\) change dtype: lm_head.weight \(stored torch.float32, "
         r"loaded torch.bfloat16 by rule 'declared'\), .* and 18 more\. Pass torch_dtype='auto'"),
        ("sharded", {"tp_rank": 0, "tp_size": 2}, r"4 tensor-parallel slice\(s\) are not one contiguous range of the file: "
         r"model.layers.0.mlp.down_proj.weight \(sliced along dim 1\).* and 1 more\. Drop mmap=True for this tensor-parallel"),
        pytest.param("sharded", {"device": "cuda"}, r"device=cuda is not host memory\. Load on cpu",
                     marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a cuda device; see the next test")),
        ("bin", {}, r"the checkpoint is torch_zip, not safetensors\. Convert it to safetensors"),
    ],
    ids=["dtype-change", "dim-1-slices", "device", "bin"],
)
def test_mmap_refuses_what_cannot_be_a_view(make_checkpoint, monkeypatch, fmt, kwargs, expected):
    path = make_checkpoint("llama", fmt)
    streamed = []
    monkeypatch.setattr(load_mod, "stream", lambda *a, **k: streamed.append(1) or iter(()))
    with pytest.raises(ValueError, match=r"mmap=True leaves every loaded tensor as a copy-on-write view of its checkpoint file, but " + expected):
        Causal.from_pretrained(path, mmap=True, **kwargs)
    assert not streamed and not _file_backed(path)  # refused while planning: no tensor byte read, nothing mapped


def test_mmap_refuses_a_device_that_is_not_host_memory(make_checkpoint):
    # On a CPU-only build device='cuda' is refused earlier (no such device: test_integrity_arguments); the mmap
    # rule itself is checked on a real plan, before any byte would be read.
    from lowmem_hf.formats.safetensors import check_mmap
    from lowmem_hf.load import prepare
    from lowmem_hf.request import make_request

    prepared = prepare(make_request(transformers.AutoModelForCausalLM, make_checkpoint("llama", "sharded"), mmap=True))
    with pytest.raises(ValueError, match=r"but device=cuda is not host memory\. Load on cpu with mmap=True"):
        check_mmap(prepared.plan, checkpoint_format=prepared.checkpoint.format, local=True, device=torch.device("cuda"))
    check_mmap(prepared.plan, checkpoint_format=prepared.checkpoint.format, local=True, device=torch.device("cpu"))


def test_mmap_and_disable_mmap_disagree(make_checkpoint):
    with pytest.raises(ValueError, match="mmap=True and disable_mmap=True disagree"):
        Causal.from_pretrained(make_checkpoint("llama", "sharded"), mmap=True, disable_mmap=True)


def test_the_ranks_of_a_node_share_its_cores_among_their_reader_threads():
    import subprocess
    import sys

    def workers(local_world_size: int) -> list[int]:
        code = "import lowmem_hf.stream as s; print(s.DEFAULT_WORKERS, s.COLD_WORKERS)"
        env = dict(os.environ, LOCAL_WORLD_SIZE=str(local_world_size))
        return [int(n) for n in subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()]

    cores = os.cpu_count() or 1
    assert workers(1) == [DEFAULT_WORKERS, COLD_WORKERS] == [min(4, cores), max(min(4, cores), min(8, 4 * cores))]
    warm, cold = workers(cores)  # as many ranks as cores: one reader each from the page cache, four from a disk
    assert (warm, cold) == (1, 4)


def test_reader_threads_follow_the_page_cache(make_checkpoint, tmp_path):
    path = shutil.copytree(make_checkpoint("llama", "sharded"), tmp_path / "llama")  # a copy nothing else maps
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    for f in files:
        open(f, "rb").read()
    assert cached_fraction(files) == 1.0
    warm = Causal.from_pretrained(path, tp_rank=0, tp_size=2).lowmem_report
    assert warm.reader_workers == DEFAULT_WORKERS and warm.page_cache_fraction == 1.0
    local_bytes = sum(p.numel() * p.element_size() for p in Causal.from_pretrained(path, tp_rank=0, tp_size=2).parameters())
    assert warm.chunk_bytes == max(256 << 10, local_bytes // (128 * DEFAULT_WORKERS))  # tiny model: staging capped
    assert warm.gap_bytes > 0  # row-wise slices: the other rank's half of each row copied by the same read
    for f in files:  # evict the (clean) pages: what a cold disk looks like to mincore
        _evict(f)
    if cached_fraction(files) > 0.5:
        pytest.skip("the kernel kept the pages in its cache (this file system ignores POSIX_FADV_DONTNEED)")
    cold = Causal.from_pretrained(path, tp_rank=0, tp_size=2).lowmem_report
    assert cold.reader_workers == COLD_WORKERS and cold.page_cache_fraction <= 0.5
    # larger reads from a cold disk: staging may take 1/32 of the bytes loaded, not 1/128
    assert cold.chunk_bytes == min(COLD_CHUNK_BYTES, max(256 << 10, local_bytes // (COLD_STAGING_SHARE * COLD_WORKERS)))
    assert cold.gap_bytes == 0  # from a cold disk a gap would be device reads for nothing


def _evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # dirty pages (the file was just written) cannot be evicted
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


@pytest.mark.parametrize("shard", [None, ShardSpec("colwise", dim=0, start=0, stop=512, tp_rank=0, tp_size=2)], ids=["whole", "dim0-slice"])
def test_bin_hint_reads_the_tensor_ahead_from_a_cold_disk(tmp_path, shard):
    # .bin shards are read through torch's mapping: a cold load asks the kernel for each tensor's pages
    # (madvise WILLNEED) when it enters the read-ahead window, instead of one small fault-driven read per thread.
    path = str(tmp_path / "w.bin")
    torch.save({"w": torch.randn(1024, 4096)}, path)  # 16 MiB, zip
    _evict(path)
    if cached_fraction([path]) > 0.1:
        pytest.skip("the kernel kept the pages in its cache (this file system ignores POSIX_FADV_DONTNEED)")
    reader = TorchReader({path: 1}, 4 << 20, True, StreamStats())
    reader.hint(TensorInfo(key="w", file=path, dtype=torch.float32, shape=(1024, 4096), offset=None), shard)
    wanted = 1.0 if shard is None else 0.5
    deadline = time.monotonic() + 10
    while cached_fraction([path]) < wanted - 0.1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cached_fraction([path]) >= wanted - 0.1
    reader.close()


def test_cold_bin_load_with_hints_is_exact(make_checkpoint, tmp_path):
    source = make_checkpoint("llama", "bin")
    path = shutil.copytree(source, tmp_path / "llama")  # a copy nothing else maps
    files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".bin")]
    for f in files:
        _evict(f)
    if cached_fraction(files) > 0.5:
        pytest.skip("the kernel kept the pages in its cache (this file system ignores POSIX_FADV_DONTNEED)")
    cold = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, tp_rank=1, tp_size=2)
    assert cold.lowmem_report.reader_workers == COLD_WORKERS  # the hinted path ran
    warm = Causal.from_pretrained(source, torch_dtype=torch.bfloat16, tp_rank=1, tp_size=2)
    for name, t in warm.state_dict().items():
        assert torch.equal(cold.state_dict()[name], t), name


@pytest.mark.parametrize(
    "runs",
    [
        [(0, 4096), (8192, 4096), (16384, 4096)],  # a 2-rank row-wise slice: 4 KiB runs, 4 KiB gaps, one call
        [(0, 100), (100 + 40 * 1024, 100)],  # a gap too wide to read through: two calls
        [(i * 24, 8) for i in range(3000)],  # more runs than one preadv may take (IOV_MAX)
        [(0, 10), (10, 10)],  # adjacent runs: no gap buffer between them
    ],
)
def test_read_runs_fills_each_run_and_nothing_else(tmp_path, runs):
    payload = os.urandom(runs[-1][0] + runs[-1][1] + 64)
    path = tmp_path / "blob"
    path.write_bytes(payload)
    outs = [bytearray(n) for _, n in runs]
    files = LocalFiles(gap_bytes=GAP_BYTES)
    files.read_runs(str(path), [(memoryview(o), offset) for o, (offset, _) in zip(outs, runs)])
    files.close()
    assert [bytes(o) for o in outs] == [payload[offset : offset + n] for offset, n in runs]
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(runs, runs[1:])]
    read_through = sum(g for g in gaps if g <= GAP_BYTES)  # less one gap per ~500 runs (a call takes 1024 buffers)
    assert read_through - len(runs) // 500 * 16 <= files.gap_bytes_read <= read_through


def test_read_runs_names_a_file_cut_inside_a_gathered_read(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(10_000))
    files = LocalFiles(gap_bytes=GAP_BYTES)
    with pytest.raises(CorruptCheckpointError, match=r"blob: expected 4000 bytes at offset 8000, the file ended after 2000"):
        files.read_runs(str(path), [(memoryview(bytearray(4000)), 0), (memoryview(bytearray(4000)), 8000)])
    files.close()


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 1024 + 8, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_bands_of_dim1_slices_are_exact(make_checkpoint, chunk_bytes, dtype):
    # A 2-rank row-wise slice from files in the page cache: bands of whole rows read by one call each and copied
    # strided (3 KiB chunks: bands of 6 rows of down_proj, 128 fp32 wide); 1-byte chunks: a row is over the chunk,
    # so each element is its own read and nothing is read between runs.
    path = make_checkpoint("llama", "sharded")
    full = Causal.from_pretrained(path, torch_dtype=dtype).state_dict()
    kwargs = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
    model, report = Causal.from_pretrained(path, torch_dtype=dtype, tp_rank=1, tp_size=2, output_loading_info=True, **kwargs)
    assert report.shards["model.layers.0.mlp.down_proj.weight"].dim == 1
    assert (report.gap_bytes > 0) == (chunk_bytes != 1)
    for name, t in model.state_dict().items():
        spec = report.shards.get(name)
        expected = full[name].narrow(spec.dim, spec.start, spec.stop - spec.start) if spec else full[name]
        assert torch.equal(t, expected), name


def test_cold_chunks_are_larger_than_warm_ones_at_real_sizes():
    # 8 cold reader threads: a 1.3 GB load may stage 1/32 of it (5 MB chunks where the warm cap of 1/128 allows
    # 1.3 MB); from 2.1 GB on, the cold chunk is COLD_CHUNK_BYTES; a tiny load stays at the 256 KiB floor
    from lowmem_hf.stream import staging_chunk_bytes

    gb = 10**9
    assert staging_chunk_bytes(1_300_000_000, COLD_CHUNK_BYTES, 8, share=COLD_STAGING_SHARE) == 1_300_000_000 // 256
    assert staging_chunk_bytes(1_300_000_000, 4 << 20, 8) == 1_300_000_000 // 1024
    assert staging_chunk_bytes(13 * gb, COLD_CHUNK_BYTES, 8, share=COLD_STAGING_SHARE) == COLD_CHUNK_BYTES
    assert staging_chunk_bytes(10**6, COLD_CHUNK_BYTES, 8, share=COLD_STAGING_SHARE) == 256 << 10
    assert staging_chunk_bytes(13 * gb, 1 << 20, 8, share=COLD_STAGING_SHARE) == 1 << 20  # an explicit chunk_bytes is a ceiling
