"""Cooperative Hub fetch: ranks on separate caches fetch each checkpoint byte once, in large spans, and hand each
other the pieces over the process group; a rank that dies or a file that changes fails every rank by name."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import transformers

from test_hub import weight_files
from lowmem_hf.sources import ByteSource
from lowmem_hf.sources.schedule import DEFAULT_WAVE_BYTES, RankRuns, schedule_spans, wave_span_bytes
from lowmem_hf.types import ShardSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "scripts", "exchange_rank.py")
SPAN = 256 * 1024
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def test_schedule_covers_the_union_once_in_spans_shared_evenly():
    # rank 0 and 1 need disjoint halves of "a" (a dim-1 slice: alternating runs) and both need "b" (replicated)
    runs = [
        [("l0", "a", i * 100, i * 100 + 50) for i in range(40)] + [("l1", "b", 0, 1000)],
        [("l0", "a", i * 100 + 50, i * 100 + 100) for i in range(40)] + [("l1", "b", 0, 1000)],
    ]
    schedule = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=300, wave_bytes=10_000)
    spans = [s for wave in schedule.waves for s in wave]
    assert schedule.wave_of == {"l0": 0, "l1": 0}
    assert [(s.file, s.start, s.stop) for s in spans] == [
        ("a", 0, 300), ("a", 300, 600), ("a", 600, 900), ("a", 900, 1200), ("a", 1200, 1500), ("a", 1500, 1800),
        ("a", 1800, 2100), ("a", 2100, 2400), ("a", 2400, 2700), ("a", 2700, 3000), ("a", 3000, 3300),
        ("a", 3300, 3600), ("a", 3600, 3900), ("a", 3900, 4000), ("b", 0, 300), ("b", 300, 600), ("b", 600, 900),
        ("b", 900, 1000),
    ]  # each byte of the union once ("b" once, not once per rank), no span over 300 bytes
    owned = [sum(s.stop - s.start for s in spans if s.owner == r) for r in (0, 1)]
    assert abs(owned[0] - owned[1]) <= 300
    small = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=300, wave_bytes=1000)
    # "l0" (4000 bytes, each rank's runs ascending) is cut into waves of 1000; "l1" fits one, in plan order
    assert small.wave_of == {"l0": 0, "l1": 4} and [sum(s.stop - s.start for s in w) for w in small.waves] == [1000] * 5


def test_a_submodule_larger_than_a_wave_is_cut_into_waves_only_where_every_rank_reads_it_in_order():
    # "emb": one tensor, rank 0 reads the first half, rank 1 the second (a row shard); "mix": rank 1 reads back
    runs = [
        [("emb", "a", 0, 2000), ("mix", "b", 0, 1500)],
        [("emb", "a", 2000, 4000), ("mix", "b", 1000, 1500), ("mix", "b", 0, 1000)],
    ]
    schedule = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=300, wave_bytes=1000)
    assert schedule.wave_of == {"emb": 0, "mix": 4} and len(schedule.waves) == 5  # "mix" stays one wave
    assert schedule.cut == {"emb"}
    assert [schedule.wave_at(0, "a", at) for at in (0, 999, 1000, 1999, 2000)] == [0, 0, 1, 1, None]
    assert [schedule.wave_at(1, "a", at) for at in (2000, 3999)] == [2, 3]
    assert schedule.wave_at(1, "a", 2000, since=3) is None
    for rank, (lo, hi) in enumerate([(0, 2000), (2000, 4000)]):  # each wave gives a rank only its own bytes
        got = [(a, b) for w in range(4) for s in schedule.waves[w] for a, b in zip(*(x.tolist() for x in schedule.pieces(rank, w, s)))]
        assert sum(b - a for a, b in got) == hi - lo and all(lo <= a < b <= hi for a, b in got)
    whole = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=300, wave_bytes=10_000)
    assert whole.cut == frozenset() and len(whole.waves) == 1


def test_the_last_waves_shrink_so_a_rank_holds_little_beside_a_nearly_loaded_model():
    mib = 1 << 20
    layers = [(f"l{i}", "a", i * 10 * mib, (i + 1) * 10 * mib) for i in range(20)]  # 200 MiB every rank reads
    schedule = schedule_spans([RankRuns.from_tuples(layers)] * 2, span_bytes=4 * mib, wave_bytes=64 * mib)
    # a wave is at most half of what is left, down to 8 MiB; whole layers as before
    assert [sum(s.stop - s.start for s in w) // mib for w in schedule.waves] == [60, 60, 40, 20, 10, 10]
    assert schedule.cut == frozenset()
    head = schedule_spans([RankRuns.from_tuples([("head", "b", 0, 100 * mib)])] * 2, span_bytes=4 * mib, wave_bytes=64 * mib)
    # one tensor larger than a wave (an output head): its cuts shrink the same way
    assert [sum(s.stop - s.start for s in w) for w in head.waves] == [50 * mib, 25 * mib, 12.5 * mib, 8 * mib, 4.5 * mib]
    assert head.cut == {"head"}


def test_spans_give_every_fetch_thread_of_every_rank_a_connection_down_to_4_mib():
    mib = 1024 * 1024
    # a default wave (64 MiB) holds 4 spans per rank: one per fetch thread, each its own capped connection
    assert wave_span_bytes(16 * mib, 2) == 8 * mib and wave_span_bytes(16 * mib, 3) == DEFAULT_WAVE_BYTES // 12
    assert wave_span_bytes(16 * mib, 1) == 16 * mib  # never above the asked-for span
    assert wave_span_bytes(16 * mib, 64) == 4 * mib  # never below 4 MiB on its own: the wave grows instead
    assert wave_span_bytes(1 * mib, 3) == 1 * mib  # a smaller span asked for is kept


def test_a_span_gives_each_rank_only_the_parts_its_runs_cover():
    # rank 0: alternating rows of "a" (a dim-1 slice), one run across a span boundary, and all of "b";
    # rank 1: the rest of "a" and none of "b"
    mine = [("l0", "a", 0, 50), ("l0", "a", 100, 150), ("l0", "a", 280, 320), ("l0", "a", 400, 450), ("l1", "b", 0, 300)]
    theirs = [("l0", "a", 50, 100), ("l0", "a", 150, 280), ("l0", "a", 320, 400), ("l0", "a", 450, 600)]
    schedule = schedule_spans([RankRuns.from_tuples(mine), RankRuns.from_tuples(theirs)], span_bytes=300, wave_bytes=10_000)
    spans = schedule.waves[0]
    assert [(s.file, s.start, s.stop) for s in spans] == [("a", 0, 300), ("a", 300, 600), ("b", 0, 300)]

    def pieces(rank):
        return [list(zip(*(x.tolist() for x in schedule.pieces(rank, 0, s)))) for s in spans]

    assert pieces(0) == [[(0, 50), (100, 150), (280, 300)], [(300, 320), (400, 450)], [(0, 300)]]
    assert pieces(1) == [[(50, 100), (150, 280)], [(320, 400), (450, 600)], []]


def test_the_pieces_of_every_span_are_exactly_the_bytes_each_rank_reads():
    rng = random.Random(0)
    runs = [[] for _ in range(3)]
    for sub in range(12):  # overlapping, touching and disjoint runs of two files, in plan order
        for rank in range(3):
            for _ in range(rng.randrange(0, 4)):
                start = rng.randrange(0, 2000)
                runs[rank].append((f"l{sub}", rng.choice("ab"), start, start + rng.randrange(1, 300)))
    schedule = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=128, wave_bytes=700)
    assert len(schedule.waves) > 2
    for rank in range(3):
        for w, wave in enumerate(schedule.waves):
            got = {f: [0] * 2300 for f in "ab"}
            for span in wave:
                for a, b in zip(*(x.tolist() for x in schedule.pieces(rank, w, span))):
                    assert span.start <= a < b <= span.stop
                    for i in range(a, b):
                        got[span.file][i] += 1
            want = {f: [0] * 2300 for f in "ab"}
            for sub, f, a, b in runs[rank]:
                for i in range(a, b):
                    if schedule.wave_at(rank, f, i, since=schedule.wave_of[sub]) == w:
                        want[f][i] = 1
            assert got == want, (rank, w)  # in each wave, each byte the rank reads there once, and nothing else
        for sub, f, a, b in runs[rank]:  # every byte a submodule reads comes in its first wave or a later one
            assert all(schedule.wave_at(rank, f, i, since=schedule.wave_of[sub]) is not None for i in range(a, b))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _saved_llama(tmp_path_factory, name: str, max_shard_size: str, **dims):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False, **dims)
    path = tmp_path_factory.mktemp(name) / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size=max_shard_size)
    return path


@pytest.fixture(scope="module")
def tp_repo(tmp_path_factory):
    return _saved_llama(tmp_path_factory, "exchange", "2MB", vocab_size=1000, hidden_size=256, intermediate_size=512,
                        num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def tp3_repo(tmp_path_factory):
    """Heads, KV heads, intermediate size and vocabulary that 3 divides: a checkpoint tp_size=3 can load."""
    return _saved_llama(tmp_path_factory, "exchange3", "4MB", vocab_size=1200, hidden_size=384, intermediate_size=768,
                        num_attention_heads=6, num_key_value_heads=3)


def _launch(hub, tp_repo, tmp_path, world: int, *, kill: dict[int, float] | None = None, wave: int | None = None,
            dtype: str | None = None):
    port, procs = _free_port(), []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p))
        argv = [sys.executable, SCRIPT, "--hub", hub.url, "--home", str(tmp_path / f"node{rank}"), "--repo", "org/tp",
                "--local", str(tp_repo), "--out", str(tmp_path), "--span", str(SPAN)]
        if kill and rank in kill:
            argv += ["--kill-after", str(kill[rank])]
        if wave is not None:
            argv += ["--wave", str(wave)]
        if dtype is not None:
            argv += ["--dtype", dtype]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs, timeout: float):
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = "TIMED OUT\n" + err
        out.append((p.returncode, err))
    return out


def test_four_nodes_fetch_each_byte_once_in_few_requests(hub_server, tp_repo, tmp_path):
    hub_server.add_repo("org/tp", tp_repo)
    hub_server.throttle_bytes_per_s = 400e6  # per connection
    hub_server.latency_s = 0.020  # per request
    hub_server.reset_counters()
    results = _finish(_launch(hub_server, tp_repo, tmp_path, 4), timeout=240)
    assert all(code == 0 for code, _ in results), "\n".join(err[-3000:] for _, err in results)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(4)]
    assert all(r["different"] == [] for r in ranks)  # bit-identical to a local load at the same tp_size
    files = weight_files(tp_repo)
    checkpoint = sum(os.path.getsize(tp_repo / f) for f in files)
    sent = sum(hub_server.bytes_for("org/tp", f) for f in files)
    assert sent <= 1.02 * checkpoint, (sent, checkpoint)
    bound = checkpoint / 4 / SPAN + 2 * len(files) + 10
    assert all(r["requests"] <= bound for r in ranks), ([r["requests"] for r in ranks], bound)
    # what the server saw on the weight files: every rank's header reads (planning) and the spans
    weight_requests = [q for q in hub_server.requests if q.filename in files and q.method == "GET"]
    assert len(weight_requests) / 4 <= bound, (len(weight_requests), bound)
    assert sum(r["fetched"] for r in ranks) < checkpoint and all(r["received"] > 0 for r in ranks)


def test_three_ranks_each_receive_only_the_bytes_their_plan_reads(hub_server, tp3_repo, tmp_path):
    hub_server.add_repo("org/tp", tp3_repo)
    hub_server.reset_counters()
    results = _finish(_launch(hub_server, tp3_repo, tmp_path, 3), timeout=240)
    assert all(code == 0 for code, _ in results), "\n".join(err[-3000:] for _, err in results)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(3)]
    assert all(r["different"] == [] for r in ranks)  # bit-identical to a local load at tp_size=3
    files = weight_files(tp3_repo)
    checkpoint = sum(os.path.getsize(tp3_repo / f) for f in files)
    assert sum(hub_server.bytes_for("org/tp", f) for f in files) <= 1.02 * checkpoint
    # bytes_read: what this rank's plan reads, headers included; a broadcast of every span gave each rank ~2/3
    # of the checkpoint, twice what it reads at tp 3
    assert all(0 < r["received"] <= 1.02 * r["read"] for r in ranks), [(r["received"], r["read"]) for r in ranks]
    assert sum(r["received"] for r in ranks) < 0.8 * checkpoint, ([r["received"] for r in ranks], checkpoint)


def test_an_embedding_and_head_cut_into_many_waves_load_identically_and_each_byte_once(hub_server, tp3_repo, tmp_path):
    # 96 KiB waves: the 1.8 MB embedding and output head come in ~19 waves each, reads straddling their boundaries
    hub_server.add_repo("org/tp", tp3_repo)
    hub_server.reset_counters()
    results = _finish(_launch(hub_server, tp3_repo, tmp_path, 3, wave=96 * 1024), timeout=240)
    assert all(code == 0 for code, _ in results), "\n".join(err[-3000:] for _, err in results)
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(3)]
    assert all(r["different"] == [] for r in ranks)  # bit-identical to a local load at tp_size=3
    assert all(r["waves"] > 30 for r in ranks), [r["waves"] for r in ranks]  # whole submodules: fewer than 10
    files = weight_files(tp3_repo)
    checkpoint = sum(os.path.getsize(tp3_repo / f) for f in files)
    assert sum(hub_server.bytes_for("org/tp", f) for f in files) <= 1.02 * checkpoint
    assert all(0 < r["received"] <= 1.02 * r["read"] for r in ranks), [(r["received"], r["read"]) for r in ranks]


@pytest.mark.parametrize("dtype", [None, "bfloat16"], ids=["stored", "converted"])
def test_bodies_cut_mid_span_still_give_identical_weights(hub_server, tp_repo, tmp_path, dtype):
    # converted (the checkpoint is fp32): direct stretches are streamed into the tensors, resumed where cut
    hub_server.add_repo("org/tp", tp_repo)
    hub_server.cut_after_bytes = 100_000  # every response breaks before a span is through
    results = _finish(_launch(hub_server, tp_repo, tmp_path, 2, dtype=dtype), timeout=240)
    assert all(code == 0 for code, _ in results), "\n".join(err[-3000:] for _, err in results)
    assert all(json.load(open(tmp_path / f"rank{r}.json"))["different"] == [] for r in range(2))


def test_a_killed_rank_makes_every_other_rank_fail_naming_it(hub_server, tp_repo, tmp_path):
    hub_server.add_repo("org/tp", tp_repo)
    hub_server.throttle_bytes_per_s = 100e3  # slow enough that the exchange is still running when rank 3 dies
    results = _finish(_launch(hub_server, tp_repo, tmp_path, 4, kill={3: 1.0}), timeout=120)
    assert results[3][0] == 17  # the killed one
    for code, err in results[:3]:
        assert code != 0 and "TIMED OUT" not in err
        assert "rank(s) [3]" in err, err[-3000:]
    # counted from the death, not from the launch: start-up on a loaded machine is not what this bounds
    killed_at = float((tmp_path / "rank3.killed_at").read_text())
    assert time.time() - killed_at < 60 + 15  # the store timeout to notice, and the ranks' exits


def test_a_file_that_changes_mid_load_fails_every_rank(hub_server, tp_repo, tmp_path):
    hub_server.add_repo("org/tp", tp_repo)
    target = sorted(weight_files(tp_repo))[0]
    grown = (tp_repo / target).read_bytes() + b"\0" * 4096

    def first_span(record) -> bool:  # not the planning reads of the header: the first span request of the file
        if record.method != "GET" or record.filename != target or not record.range:
            return False
        start, _, end = record.range.removeprefix("bytes=").partition("-")
        return int(end) - int(start) + 1 >= 64 * 1024

    hub_server.replace_file("org/tp", target, grown, when=first_span)
    results = _finish(_launch(hub_server, tp_repo, tmp_path, 2), timeout=240)
    for code, err in results:
        assert code != 0 and "RemoteFileChangedError" in err and target in err, err[-3000:]


def test_stretches_only_one_rank_reads_are_fetched_by_it_and_only_shared_bytes_are_in_spans():
    # "a": a dim-0 split with an overlap (rank 0 reads [0, 6000), rank 1 [5000, 10000)); "b": replicated; "c": a
    # dim-1 slice (alternating 50-byte runs); "d": a short stretch only rank 0 reads
    runs = [
        [("l0", "a", 0, 6000), ("l1", "b", 0, 1000)] + [("l2", "c", i * 100, i * 100 + 50) for i in range(20)] + [("l3", "d", 0, 500)],
        [("l0", "a", 5000, 10000), ("l1", "b", 0, 1000)] + [("l2", "c", i * 100 + 50, i * 100 + 100) for i in range(20)],
    ]
    schedule = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=300, wave_bytes=2000, direct_bytes=1000)
    assert [(s.file, s.start, s.stop) for s in sorted({s for w in schedule.waves for s in w}, key=lambda s: (s.file, s.start))] == [
        ("a", 5000, 5300), ("a", 5300, 5600), ("a", 5600, 5900), ("a", 5900, 6000),
        ("b", 0, 300), ("b", 300, 600), ("b", 600, 900), ("b", 900, 1000),
        ("c", 0, 300), ("c", 300, 600), ("c", 600, 900), ("c", 900, 1200), ("c", 1200, 1500), ("c", 1500, 1800),
        ("c", 1800, 2000), ("d", 0, 300), ("d", 300, 500),
    ]  # the overlap, the replicated and the interleaved bytes, and the short stretch: nothing else
    assert [schedule.direct_at(0, "a", at) for at in (0, 4999, 5000)] == [5000, 5000, None]
    assert [schedule.direct_at(1, "a", at) for at in (5999, 6000, 9999, 10000)] == [None, 10000, 10000, None]
    assert schedule.direct_at(1, "a", 0) is None and schedule.direct_at(0, "d", 0) is None and schedule.direct_at(0, "zz", 0) is None
    # the direct bytes count as owned: rank 0 fetches 5000 itself, rank 1 4000, so rank 1 owns more of the spans
    owned = [sum(s.stop - s.start for w in schedule.waves for s in w if s.owner == r) for r in (0, 1)]
    assert owned[1] > owned[0] and abs((owned[0] + 5000) - (owned[1] + 4000)) <= 300
    # "l0" (10000 bytes) would be cut into waves of 2000; its shared bytes (1000) fit one: it is not cut
    assert schedule.cut == frozenset()
    assert schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=300, wave_bytes=2000).cut == {"l0"}
    for rank in range(2):  # from the spans each rank gets exactly the bytes it reads that are not its direct ones
        got = {f: 0 for f in "abcd"}
        for w, wave in enumerate(schedule.waves):
            for s in wave:
                starts, stops = schedule.pieces(rank, w, s)
                got[s.file] += int((stops - starts).sum())
        assert got == [{"a": 1000, "b": 1000, "c": 1000, "d": 500}, {"a": 1000, "b": 1000, "c": 1000, "d": 0}][rank]


def test_a_run_across_a_direct_stretch_keeps_only_its_shared_parts_in_plan_order():
    # rank 0 reads "a" [0, 3000) then [3000, 3100) in one run that spans [2500, 3100): only [3000, 3100) is shared
    runs = [
        [("l0", "a", 0, 2500), ("l0", "a", 2500, 3100), ("l1", "a", 4000, 4100)],
        [("l0", "a", 3000, 3100), ("l1", "a", 4000, 4100)],
    ]
    schedule = schedule_spans([RankRuns.from_tuples(r) for r in runs], span_bytes=1000, wave_bytes=10_000, direct_bytes=1000)
    assert schedule.direct_at(0, "a", 0) == 3000 and schedule.direct_at(0, "a", 3000) is None
    assert [(s.start, s.stop) for s in schedule.waves[0]] == [(3000, 3100), (4000, 4100)]
    keys, starts, stops = schedule.needs[0]
    assert list(zip(starts.tolist(), stops.tolist())) == [(3000, 3100), (4000, 4100)]


class _Streaming(ByteSource):
    """A byte source over ``data`` that streams every range in pieces of the sizes given, cycling (odd ones split
    elements between pieces), and counts what it served; ``retry_at``: the first request is handed over up to
    there, then again from its start, as a retried request is."""

    def __init__(self, data: bytes, sizes: list[int], retry_at: int | None = None):
        self._data, self._sizes, self._retry_at = data, sizes, retry_at
        self.streamed = 0

    def streams(self, file, offset, nbytes):
        return True

    def read(self, file, view, offset):
        raise AssertionError("a streaming source's converted reads come through read_streamed")

    def read_streamed(self, file, offset, nbytes, consume):
        def hand(stop):
            at, k = 0, 0
            while at < stop:
                n = min(self._sizes[k % len(self._sizes)], stop - at)
                consume(memoryview(bytearray(self._data[offset + at : offset + at + n])), at)
                at, k = at + n, k + 1

        if self._retry_at is not None:
            hand(min(self._retry_at, nbytes))
            self._retry_at = None
        hand(nbytes)
        self.streamed += nbytes


@pytest.mark.parametrize("sizes, retry_at", [([4096], None), ([3, 5, 1000, 7], None), ([1, 2, 999], 1001)])
def test_a_streamed_read_converts_each_piece_as_it_comes_even_where_an_element_is_split(sizes, retry_at):
    from lowmem_hf.formats.base import RangeReader, StreamStats
    from lowmem_hf.types import TensorInfo

    stored = torch.randn(40, 33, generator=torch.Generator().manual_seed(0))
    data = b"\0" * 12 + stored.numpy().tobytes()
    info = TensorInfo(key="w", file="f", dtype=torch.float32, shape=(40, 33), offset=12)
    for shard, want in [(None, stored), (ShardSpec(style="rowwise", dim=1, start=5, stop=20, tp_rank=0, tp_size=1), stored[:, 5:20])]:
        source = _Streaming(data, sizes, retry_at)
        reader = RangeReader({"f": 1}, 512, StreamStats(), source)
        dst = torch.empty(want.shape, dtype=torch.bfloat16)
        for job in reader.jobs(info, dst, shard):
            job()
        assert torch.equal(dst, want.to(torch.bfloat16))  # what transformers' cast gives, bit for bit
        assert source.streamed == want.numel() * 4  # no staging read: every byte came through the pieces


def test_a_read_that_must_run_the_next_wave_waits_for_every_earlier_read_of_its_submodule():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from lowmem_hf.sources.exchange import _InOrder

    order, seen = _InOrder(4), []
    release = threading.Event()

    def slow():  # read 0 holds the current wave until released
        release.wait(10)
        seen.append("0 done")

    def advances():  # read 2 must run the next wave: not before reads 0 and 1 are done
        _InOrder.wait_for_earlier()
        seen.append("2 advances")

    jobs = [slow, lambda: seen.append("1 done"), advances, lambda: seen.append("3 done")]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(order.run, i, job) for i, job in enumerate(jobs)]
        time.sleep(0.3)
        assert "2 advances" not in seen and "3 done" in seen  # later reads that need no new wave are not held up
        release.set()
        for future in futures:
            future.result(timeout=10)
    assert seen.index("2 advances") > seen.index("0 done")
    _InOrder.wait_for_earlier()  # outside a cut submodule's read: returns at once


def test_the_stream_reads_ahead_only_within_the_wave_held_and_never_into_a_cut_submodule():
    from types import SimpleNamespace

    from lowmem_hf.sources.exchange import CooperativeRanges

    # both ranks read everything (replicated): "l0" and "l1" make wave 0, "l2" opens wave 1, "emb" is cut into waves
    # 1-3, and "l3" fits the rest of wave 3
    runs = [("l0", "a", 0, 400), ("l1", "a", 400, 800), ("l2", "a", 800, 1200), ("emb", "b", 0, 2500), ("l3", "a", 1200, 1300)]
    schedule = schedule_spans([RankRuns.from_tuples(runs)] * 2, span_bytes=300, wave_bytes=1000)
    assert schedule.wave_of == {"l0": 0, "l1": 0, "l2": 1, "emb": 1, "l3": 3} and schedule.cut == {"emb"}
    source = CooperativeRanges.__new__(CooperativeRanges)  # the decision only: no process group
    source._schedule = schedule

    def may(name: str, held: int) -> bool:
        source._waves = SimpleNamespace(next=held + 1)
        return source.may_read_ahead(name)

    assert may("l1", held=0) and not may("l2", held=0)  # a later wave would drop the one earlier reads still read
    assert may("l2", held=1) and not may("emb", held=1)  # a cut submodule's reads run the waves themselves
    assert not may("l3", held=2) and may("l3", held=3)  # behind a cut submodule once its last wave is held
    assert may("not-in-any-plan", held=0)  # no bytes in any wave


def _held(runs: list[tuple[int, int]]):
    """A wave's ``Pieces`` of file "f" holding ``runs`` received packed, and their bytes in that order."""
    from lowmem_hf.sources.pieces import Pieces

    data = torch.arange(sum(b - a for a, b in runs), dtype=torch.uint8)
    pieces = Pieces()
    pieces.add(np.array([a for a, _ in runs]), np.array([b for _, b in runs]), data, packed=True)
    pieces.seal()
    return pieces, data.numpy().tobytes()


def test_rows_held_next_to_each_other_are_handed_over_as_one_piece_and_the_rest_is_read():
    from types import SimpleNamespace

    from lowmem_hf.sources.exchange import CooperativeRanges

    pieces, packed = _held([(0, 40), (100, 140), (200, 240)])  # three rows of a dim-1 slice, received packed
    assert pieces.locate(100, 40) == (pieces.locate(0, 8)[0], 40) and pieces.locate(100, 41) is None
    source = CooperativeRanges.__new__(CooperativeRanges)
    source._waves = SimpleNamespace(held={"f": pieces}, next=1)
    read = []

    def read_streamed(file, offset, nbytes, consume):  # what is not held: a direct request or a later wave
        read.append((file, offset, nbytes))
        consume(memoryview(b"x" * nbytes), 0)

    source.read_streamed = read_streamed
    got = []
    source.read_runs_streamed("f", [(0, 40), (100, 40), (300, 8), (200, 40)], lambda piece, at: got.append((bytes(piece), at)))
    # one conversion for the first two rows, the row not held read by itself, then the third row
    assert got == [(packed[:80], 0), (b"x" * 8, 80), (packed[80:], 88)] and read == [("f", 300, 8)]

    views = [memoryview(bytearray(n)) for n in (40, 40, 8, 40)]

    def read_into(file, view, offset):
        read.append((file, offset, len(view)))
        view[:] = b"y" * len(view)

    source.read = read_into
    source.read_runs("f", list(zip(views, (0, 100, 300, 200))))
    assert [bytes(v) for v in views] == [packed[:40], packed[40:80], b"y" * 8, packed[80:]] and read[-1] == ("f", 300, 8)
