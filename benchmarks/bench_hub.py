"""Hub fetch benchmark: the generated ~2 GB fp32 Llama served by the loopback fake Hub at a fixed rate.

    python benchmarks/bench_hub.py [--size-gb 2.0] [--rate-mb 400] [--latency-ms 20] [--ranks 2 4]

For transformers (downloads every shard into the cache) and lowmem_hf with fetch="files" and
fetch="ranges" (under a process group: the cooperative fetch), in one process and in each `--ranks`
count of tensor-parallel ranks with a separate HF cache each ("nodes"), it prints the time to a loaded
model (download included, as bf16), the bytes the server sent as a multiple of the checkpoint's size, and
the requests per rank. The server is throttled per connection and adds a fixed latency to every request
(a real Hub's per-request cost). Every run starts with an empty cache.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO / "tests"))  # after HERE: tests/ has its own checkpoints.py

from checkpoints import make_llama_checkpoint  # noqa: E402
from hub_server import HubServer  # noqa: E402  (the tests' loopback Hub)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(server: HubServer, scratch: Path, loader: str, fetch: str, ranks: int) -> dict:
    server.reset_counters()
    port, procs = free_port(), []
    for rank in range(ranks):
        home = scratch / f"home-{loader}-{fetch}-{ranks}-{rank}"
        shutil.rmtree(home, ignore_errors=True)
        env = server.subprocess_env(home)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        env["OMP_NUM_THREADS"] = "1"
        argv = [sys.executable, str(HERE / "_hub_child.py"), "--loader", loader, "--fetch", fetch]
        if ranks > 1:
            argv.append("--tp")
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    seconds = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{loader}/{fetch}/{ranks} ranks failed:\n{err[-3000:]}")
        seconds.append(json.loads(next(line for line in out.splitlines() if line.startswith("@@RESULT "))[9:])["seconds"])
    for rank in range(ranks):
        shutil.rmtree(scratch / f"home-{loader}-{fetch}-{ranks}-{rank}", ignore_errors=True)
    return {"loader": loader, "fetch": fetch, "ranks": ranks, "seconds": max(seconds), "bytes": server.bytes_for("org/bench"),
            "requests_per_rank": len(server.requests) / ranks,
            "weight_gets_per_rank": sum(q.method == "GET" and q.filename.endswith(".safetensors") for q in server.requests if q.filename) / ranks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--rate-mb", type=float, default=400.0, help="server throttle, MB/s per connection")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="server latency added to every request")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    checkpoint = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    size = sum(f.stat().st_size for f in Path(checkpoint).iterdir() if f.suffix == ".safetensors")
    scratch = Path(tempfile.mkdtemp(prefix="bench-hub-", dir=workdir))
    server = HubServer(scratch / "hub", lfs_patterns=HubServer.HF_DEFAULT_LFS_PATTERNS)
    server.add_repo("org/bench", checkpoint, link=True)
    server.throttle_bytes_per_s = int(args.rate_mb * 1e6)
    server.latency_s = args.latency_ms / 1e3
    rows = []
    try:
        with server:
            for ranks in (1, *args.ranks):
                for loader, fetch in (("transformers", "-"), ("lowmem", "files"), ("lowmem", "ranges")):
                    row = run(server, scratch, loader, fetch if fetch != "-" else "files", ranks)
                    row["fetch"] = fetch
                    rows.append(row)
                    print(f"  {loader:12s} fetch={fetch:6s} ranks={ranks}  {row['seconds']:6.2f}s  "
                          f"sent {row['bytes'] / 1e9:.2f} GB ({row['bytes'] / size:.2f}x checkpoint)  "
                          f"{row['requests_per_rank']:.0f} requests per rank ({row['weight_gets_per_rank']:.0f} GETs of weight files)", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nSummary: checkpoint {size / 1e9:.2f} GB fp32 -> bf16, server throttled to {args.rate_mb:.0f} MB/s per "
          f"connection, +{args.latency_ms:.0f} ms per request")
    print("  loader        fetch   ranks  time-to-model  vs transformers  bytes sent / checkpoint  requests per rank")
    for row in rows:
        base = next(r for r in rows if r["loader"] == "transformers" and r["ranks"] == row["ranks"])
        print(f"  {row['loader']:12s}  {row['fetch']:6s}  {row['ranks']:5d}  {row['seconds']:12.2f}s  "
              f"{row['seconds'] / base['seconds']:14.2f}x  {row['bytes'] / size:22.2f}x  {row['requests_per_rank']:17.0f}")
    (workdir / "results-hub-latest.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
