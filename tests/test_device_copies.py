"""Copies of staged chunks to a device (``CopyRing``): the order that lets reads overlap copies, run on the CPU with a
thread standing in for a CUDA side stream, and the switches that turn it off."""

import dataclasses
import itertools
import queue
import threading
import time
from typing import ClassVar

import pytest
import torch
import transformers

from lowmem_hf import settings
from lowmem_hf.auto import AUTO_CLASSES
from lowmem_hf.formats.base import StreamStats
from lowmem_hf.formats.staging import CopyRing, Staging

Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]


class ThreadLane:
    """A lane on the CPU: one thread runs the submitted copies in order, each after a pause, so that a buffer refilled
    before its copy ran shows in the copied values. Same methods as ``CudaLane``."""

    instances: ClassVar[list] = []

    def __init__(self, device, pause: float = 0.002):
        self.pause, self.submitted, self.ran = pause, 0, 0
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()
        ThreadLane.instances.append(self)

    @staticmethod
    def fence(device):
        return None  # host memory is not allocated in stream order

    def after(self, mark) -> None:
        pass

    def submit(self, copy) -> None:
        self.submitted += 1
        self._queue.put(copy)

    def mark(self):
        done = threading.Event()
        self._queue.put(done.set)
        return _Mark(done)

    def publish(self) -> None:
        self.synchronize()

    def synchronize(self) -> None:
        self.mark().synchronize()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if not isinstance(getattr(job, "__self__", None), threading.Event):
                time.sleep(self.pause)
                self.ran += 1
            job()


class _Mark:
    def __init__(self, done: threading.Event):
        self._done = done

    def synchronize(self) -> None:
        assert self._done.wait(30), "a copy never ran"


def _ring(stats=None, *, depth=2, convert_on_device=False):
    return CopyRing(stats or StreamStats(), device=torch.device("cpu"), lane=ThreadLane, depth=depth, convert_on_device=convert_on_device)


def test_the_thread_lane_really_runs_copies_later():
    # the control for the tests below: refilling a buffer right after submitting its copy changes what lands
    lane = ThreadLane("cpu", pause=0.05)
    buf, out = torch.ones(4), torch.zeros(4)
    lane.submit(lambda: out.copy_(buf))
    buf.fill_(2)
    lane.synchronize()
    assert out.tolist() == [2, 2, 2, 2]


def test_each_thread_alternates_two_buffers_and_refills_one_only_after_its_copies_ran():
    ring = _ring()
    outs, pointers, ran_before = [], [], {}
    for i in range(8):
        buf = ring.get(64)
        if buf.data_ptr() in ran_before:  # every copy out of this buffer has run before it is handed out again
            assert ThreadLane.instances[-1].ran >= ran_before[buf.data_ptr()]
        pointers.append(buf.data_ptr())
        buf.view(torch.float32).fill_(i)
        outs.append(torch.empty(16))
        ring.copy(outs[-1], buf.view(torch.float32))
        ran_before[buf.data_ptr()] = ThreadLane.instances[-1].submitted
    ring.synchronize()
    assert len(set(pointers)) == 2 and all(a != b for a, b in itertools.pairwise(pointers))
    assert [o[0].item() for o in outs] == list(range(8)) and all(torch.equal(o, o[:1].expand(16)) for o in outs)


def test_staging_is_two_chunks_per_thread_with_overlap_and_one_without():
    for depth in (2, 1):
        stats = StreamStats()
        ring = _ring(stats, depth=depth)
        barrier = threading.Barrier(2)

        def work(ring, barrier):
            barrier.wait()
            for _ in range(5):
                buf = ring.get(1000)
                ring.copy(torch.empty(1000, dtype=torch.uint8), buf)

        threads = [threading.Thread(target=work, args=(ring, barrier)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ring.synchronize()
        assert stats.staging_bytes == 2 * depth * 1000


def test_without_overlap_one_buffer_is_reused_and_the_next_read_waits_for_its_copy():
    ring = _ring(depth=1)
    first = ring.get(16)
    first.view(torch.float32).fill_(3)
    out = torch.empty(4)
    ring.copy(out, first.view(torch.float32))
    assert ring.get(16).data_ptr() == first.data_ptr()
    assert out.tolist() == [3, 3, 3, 3]  # done before the buffer came back


def test_both_switches_off_leave_a_cuda_load_on_the_one_buffer_blocking_path():
    staging = Staging(StreamStats(), overlap=False, convert_on_device=False)
    assert staging._ring_for(torch.device("cuda", 0)) is None
    assert Staging(StreamStats())._ring_for(torch.device("cpu")) is None  # a CPU destination never takes the ring


@pytest.mark.parametrize("depth", [2, 1])
def test_converted_and_strided_chunks_land_exactly_through_the_device_buffer(depth):
    stats = StreamStats()
    ring = _ring(stats, depth=depth, convert_on_device=True)
    expected, outs = [], []
    for i in range(6):
        buf = ring.get(10 * 8 * 4)
        stored = buf.view(torch.float32)
        stored.copy_(torch.randn(80, generator=torch.Generator().manual_seed(i)))
        rows = stored[8:].as_strided((6, 5), (12, 1))  # equal runs at a stride, as a dim-1 slice is read
        expected.append(rows.to(torch.bfloat16))
        outs.append(torch.empty(6, 5, dtype=torch.bfloat16))
        ring.copy(outs[-1], rows)
    ring.synchronize()
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
    assert stats.device_staging_bytes == ((6 - 1) * 12 + 5) * 4  # one buffer per thread: the span of the strided rows


@pytest.mark.parametrize("overlap,convert", [(True, True), (True, False), (False, True), (False, False)])
def test_a_load_through_the_ring_is_bit_identical_to_transformers(make_checkpoint, monkeypatch, overlap, convert):
    # the CPU stands in for the device: the same ring, a thread for each side stream
    rings = []

    def ring_for(self, device):
        with self._lock:
            if self._ring is None and (overlap or convert):
                self._ring = CopyRing(
                    self._stats, device=device, lane=ThreadLane, depth=2 if overlap else 1, convert_on_device=convert,
                )
                rings.append(self._ring)
        return self._ring

    monkeypatch.setattr(Staging, "_ring_for", ring_for)
    path = make_checkpoint("llama", "sharded")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    lanes = len(ThreadLane.instances)
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, chunk_bytes=1000)
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name
    assert len(rings) == (1 if overlap or convert else 0)  # both off: the one-buffer blocking path, no ring
    submitted = sum(lane.submitted for lane in ThreadLane.instances[lanes:])
    assert submitted > 100 if rings else submitted == 0
    if convert:  # the converted chunks went to the "device" as stored bytes and were converted there
        assert rings[0]._stats.device_staging_bytes > 0


@pytest.mark.parametrize("value", ["0", "1", None])
def test_a_public_cpu_load_is_bit_identical_to_transformers_with_either_switch(make_checkpoint, monkeypatch, value):
    for name in ("LOWMEM_HF_GPU_OVERLAP", "LOWMEM_HF_GPU_CONVERT_ON_DEVICE"):
        monkeypatch.delenv(name, raising=False) if value is None else monkeypatch.setenv(name, value)
    path = make_checkpoint("llama", "sharded")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16)
    for name, t in ref.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name
    said = [n for n in got.lowmem_report.notes if "applies to loads onto a CUDA device" in n]
    assert len(said) == (2 if value == "1" else 0)


def test_switches_read_0_and_1_and_refuse_anything_else(monkeypatch):
    monkeypatch.delenv("LOWMEM_HF_GPU_OVERLAP", raising=False)
    assert settings.gpu_overlap() is None
    monkeypatch.setenv("LOWMEM_HF_GPU_OVERLAP", "0")
    assert settings.gpu_overlap() is False
    monkeypatch.setenv("LOWMEM_HF_GPU_CONVERT_ON_DEVICE", "1")
    assert settings.gpu_convert_on_device() is True
    monkeypatch.setenv("LOWMEM_HF_GPU_OVERLAP", "off")
    with pytest.raises(ValueError, match=r"LOWMEM_HF_GPU_OVERLAP='off': expected 0 \(off\) or 1 \(on\)"):
        settings.gpu_overlap()


@pytest.mark.parametrize("overlap,convert", [(True, True), (True, False), (False, True)])
def test_a_tensor_parallel_slice_through_the_ring_equals_the_plain_load(make_checkpoint, monkeypatch, overlap, convert):
    # dim-1 slices are read as bands of whole rows (strided runs): gathered on the "device" when converting there
    path = make_checkpoint("llama", "sharded")
    plain = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, tp_rank=1, tp_size=2, chunk_bytes=1000)

    def ring_for(self, device):
        with self._lock:
            if self._ring is None:
                self._ring = CopyRing(
                    self._stats, device=device, lane=ThreadLane, depth=2 if overlap else 1, convert_on_device=convert,
                )
        return self._ring

    monkeypatch.setattr(Staging, "_ring_for", ring_for)
    got = Causal.from_pretrained(path, torch_dtype=torch.bfloat16, tp_rank=1, tp_size=2, chunk_bytes=1000)
    for name, t in plain.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


def test_a_training_checkpoint_through_the_ring_equals_the_plain_load(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False))
    model.config.save_pretrained(tmp_path)
    dcp.save(model.state_dict(), checkpoint_id=tmp_path, no_dist=True)
    plain = Causal.from_pretrained(tmp_path, torch_dtype=torch.bfloat16, chunk_bytes=1000)

    def ring_for(self, device):
        with self._lock:
            if self._ring is None:
                self._ring = CopyRing(self._stats, device=device, lane=ThreadLane, depth=2, convert_on_device=True)
        return self._ring

    monkeypatch.setattr(Staging, "_ring_for", ring_for)
    lanes = len(ThreadLane.instances)
    got = Causal.from_pretrained(tmp_path, torch_dtype=torch.bfloat16, chunk_bytes=1000)
    assert sum(lane.submitted for lane in ThreadLane.instances[lanes:]) > 0
    for name, t in plain.state_dict().items():
        assert torch.equal(got.state_dict()[name], t), name


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_the_dry_run_predicts_the_pinned_staging_of_a_cuda_load(make_checkpoint, monkeypatch, overlap):
    # onto a CUDA device every chunk is staged, the same dtype too (a device destination cannot take a preadv),
    # in two buffers per reader thread while copies overlap reads; planning needs no device
    from lowmem_hf.load import prepare
    from lowmem_hf.request import make_request

    monkeypatch.setenv("LOWMEM_HF_GPU_OVERLAP", overlap)
    path = make_checkpoint("llama", "sharded")
    on_cpu = prepare(make_request(transformers.AutoModelForCausalLM, path)).estimate()
    # the request as a CUDA load makes it (this machine has no device to validate one against)
    cuda = dataclasses.replace(make_request(transformers.AutoModelForCausalLM, path), device=torch.device("cuda", 0))
    prepared = prepare(cuda)
    on_cuda = prepared.estimate()
    largest = max(r.source.dtype.itemsize * torch.Size(r.local_shape).numel() for r in prepared.plan.reads)
    per_thread = min(prepared.stream_chunk_bytes, largest)
    assert on_cpu.staging_bytes == 0  # same dtype onto the CPU: straight into the destinations
    assert on_cuda.staging_bytes == prepared.workers * per_thread * (2 if overlap == "1" else 1)
    assert on_cuda.predicted_peak_bytes == on_cuda.final_bytes + on_cuda.staging_bytes
