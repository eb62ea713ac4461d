"""How the cooperative fetch's coordination grows with the ranks: 2, 4, 8 and 16 TP ranks, one loopback Hub.

    python benchmarks/bench_coop.py [--ranks 2 4 8 16] [--workdir /tmp/scale]

A small Llama (hidden 512, 16 heads and KV heads so every rank count divides them, 4 layers, vocabulary 8000,
fp32, 75 MB) is served by the tests' loopback Hub, unthrottled; each rank is a process with its own HF cache (a
"node") loading it as bf16 with ``fetch="ranges"``, ``tp_plan="auto"`` under a gloo group (``_coop_child.py``).
Per rank count it prints the job's time (slowest rank), and per rank (the most over the ranks): store
operations (the status rounds), collective calls, point-to-point messages, HTTP requests to the Hub (mean), and
bytes received from other ranks against the bytes the rank's plan reads. On 2 shared cores 16 ranks mostly
measure the CPU; the counts are what this benchmark is for.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO / "tests"))

from measure import free_port  # noqa: E402
from checkpoints import make_llama_checkpoint  # noqa: E402
from hub_server import HubServer  # noqa: E402

DIMS = dict(hidden=512, inter=1024, layers=4, heads=16, kv_heads=16, vocab=8000)


def run(server: HubServer, scratch: Path, ranks: int) -> dict:
    server.reset_counters()
    port, procs = free_port(), []
    for rank in range(ranks):
        home = scratch / f"home-{ranks}-{rank}"
        shutil.rmtree(home, ignore_errors=True)
        env = server.subprocess_env(home)
        env.update(PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(HERE / "_coop_child.py")], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{ranks} ranks failed:\n{err[-3000:]}")
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("@@RESULT "))[9:]))
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()

    def most(pred) -> int:
        return max(sum(n for k, n in r["counts"].items() if pred(k)) for r in results)

    return {
        "ranks": ranks, "seconds": max(r["seconds"] for r in results),
        "store": most(lambda k: k.startswith("store.")),
        "store_by_kind": {k: max(r["counts"].get(k, 0) for r in results)
                          for k in sorted({k for r in results for k in r["counts"] if k.startswith("store.")})},
        "collectives": most(lambda k: k.startswith("dist.") and k not in ("dist.isend", "dist.irecv")),
        "p2p": most(lambda k: k in ("dist.isend", "dist.irecv")),
        "requests": len(server.requests) / ranks,
        "received": max(r["bytes_received"] for r in results),
        "received_vs_read": max(r["bytes_received"] / r["bytes_read"] for r in results),
        "server_bytes": server.bytes_for("org/coop"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--workdir", default="/tmp/scale")
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    checkpoint = make_llama_checkpoint(workdir, 0.075, torch.float32, dims=DIMS, name="coop")
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    scratch = Path(tempfile.mkdtemp(prefix="bench-coop-", dir=workdir))
    server = HubServer(scratch / "hub", lfs_patterns=HubServer.HF_DEFAULT_LFS_PATTERNS)
    server.add_repo("org/coop", checkpoint, link=True)
    rows = []
    with server:
        for ranks in args.ranks:
            homes = scratch / "homes"
            homes.mkdir(exist_ok=True)
            row = run(server, homes, ranks)
            print(f"  {ranks} ranks: {row}", flush=True)
            rows.append(row)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"\ncheckpoint {size / 1e6:.0f} MB; per rank = the most over the ranks (requests: the mean)")
    print("| ranks | time | store ops / rank | collective calls / rank | p2p messages / rank | Hub requests / rank | "
          "received / rank | received / read | server sent / checkpoint |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['ranks']} | {r['seconds']:.2f} s | {r['store']} | {r['collectives']} | {r['p2p']} | {r['requests']:.1f} | "
              f"{r['received'] / 1e6:.1f} MB | {r['received_vs_read']:.3f} | {r['server_bytes'] / size:.3f} |")
    print("store ops by kind (most over the ranks): " + "; ".join(f"{r['ranks']} ranks {r['store_by_kind']}" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
