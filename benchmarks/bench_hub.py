"""Hub fetch benchmark: the generated ~2 GB fp32 Llama served by the loopback fake Hub at a fixed rate.

    python benchmarks/bench_hub.py [--shape llama|llama-tp3|smollm2-135m] [--size-gb 2.0] [--rate-mb 400]
        [--latency-ms 20] [--ranks 2 4] [--repeats 1] [--fetch files ranges]

For transformers (downloads every shard into the cache) and lowmem_hf with fetch="files" and
fetch="ranges" (under a process group: the cooperative fetch), in one process and in each `--ranks`
count of tensor-parallel ranks with a separate HF cache each ("nodes"), it prints the time to a loaded
model (download included, as bf16), the bytes the server sent as a multiple of the checkpoint's size, the
requests per rank and, for lowmem_hf, the bytes a rank received from the other ranks (the cooperative fetch)
against the bytes its plan reads (headers included), the largest ratio over the ranks. The server is
throttled per connection and adds a fixed latency to every request (a real Hub's per-request cost). Every run
starts with an empty cache; with ``--repeats`` the cases alternate and the times are medians.

Shapes: ``llama``, the benchmarks' generated Llama (``checkpoints.py``; 16 heads, so tp 2 and 4 only);
``llama-tp3``, a Llama of ``--size-gb`` in fp32 whose heads (9), KV heads (3), intermediate size and
vocabulary 3 divides; ``smollm2-135m``, SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads,
vocabulary 49152, tied embeddings) stored in bf16 as on the Hub, 269 MB. Values are seeded random.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO / "tests"))  # after HERE: tests/ has its own checkpoints.py

from checkpoints import _fresh_dir, _read_marker, _shard_size, make_llama_checkpoint  # noqa: E402
from hub_server import HubServer  # noqa: E402  (the tests' loopback Hub)
from measure import free_port  # noqa: E402


SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "llama-tp3": dict(hidden_size=1152, intermediate_size=4608, num_attention_heads=9, num_key_value_heads=3,
                      vocab_size=49152, tie_word_embeddings=False),  # layers from --size-gb
}


def make_shaped_checkpoint(workdir: Path, shape: str, size_gb: float) -> Path:
    """A seeded Llama checkpoint of one of ``SHAPES`` (cached in the workdir, like ``checkpoints.py``'s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(SHAPES[shape])
    dtype = torch.bfloat16 if shape == "smollm2-135m" else torch.float32
    if "num_hidden_layers" not in dims:
        h, i, v, kv = dims["hidden_size"], dims["intermediate_size"], dims["vocab_size"], dims["num_key_value_heads"]
        per_layer = 2 * h * h + 2 * h * kv * (h // dims["num_attention_heads"]) + 3 * h * i + 2 * h
        dims["num_hidden_layers"] = max(2, round((size_gb * 1e9 / 4 - 2 * v * h) / per_layer))
    out = workdir / (shape if shape == "smollm2-135m" else f"{shape}-{size_gb:g}gb")
    want = {"dims": dims, "dtype": str(dtype), "seed": 1234}
    marker = _read_marker(out)
    if marker is not None and all(marker.get(k) == v for k, v in want.items()):
        return out
    print(f"[bench_hub] generating {out} ({dims}) ...", flush=True)
    _fresh_dir(out)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=2048, **dims))
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, p in model.named_parameters():
            w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
            p.data = (w.add_(1.0) if p.ndim == 1 else w).to(dtype)
    model.tie_weights()
    model.config.dtype = dtype
    model.save_pretrained(out, max_shard_size=_shard_size(model))
    (out / "bench_checkpoint.json").write_text(json.dumps(want))
    return out


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
    results = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"{loader}/{fetch}/{ranks} ranks failed:\n{err[-3000:]}")
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("@@RESULT "))[9:]))
    for rank in range(ranks):
        shutil.rmtree(scratch / f"home-{loader}-{fetch}-{ranks}-{rank}", ignore_errors=True)
    received = [r.get("bytes_received", 0) / r["bytes_read"] if r.get("bytes_read") else None for r in results]
    return {"loader": loader, "fetch": fetch, "ranks": ranks, "seconds": max(r["seconds"] for r in results),
            "bytes": server.bytes_for("org/bench"),
            "received_per_rank": [r.get("bytes_received") for r in results],
            "read_per_rank": [r.get("bytes_read") for r in results],
            "received_vs_read": None if None in received else max(received),
            "requests_per_rank": len(server.requests) / ranks,
            "weight_gets_per_rank": sum(q.method == "GET" and q.filename.endswith(".safetensors") for q in server.requests if q.filename) / ranks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["llama", *SHAPES], default="llama")
    parser.add_argument("--size-gb", type=float, default=2.0, help="fp32 size of the llama and llama-tp3 shapes")
    parser.add_argument("--rate-mb", type=float, default=400.0, help="server throttle, MB/s per connection")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="server latency added to every request")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of every case; times are medians")
    parser.add_argument("--fetch", nargs="+", choices=["files", "ranges"], default=["files", "ranges"],
                        help="lowmem_hf's fetch modes to run (transformers always runs)")
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    if args.shape == "llama":
        checkpoint = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    else:
        checkpoint = make_shaped_checkpoint(workdir, args.shape, args.size_gb)
    size = sum(f.stat().st_size for f in Path(checkpoint).iterdir() if f.suffix == ".safetensors")
    scratch = Path(tempfile.mkdtemp(prefix="bench-hub-", dir=workdir))
    server = HubServer(scratch / "hub", lfs_patterns=HubServer.HF_DEFAULT_LFS_PATTERNS)
    server.add_repo("org/bench", checkpoint, link=True)
    server.throttle_bytes_per_s = int(args.rate_mb * 1e6)
    server.latency_s = args.latency_ms / 1e3
    cases = [(ranks, loader, fetch) for ranks in (1, *args.ranks)
             for loader, fetch in (("transformers", "-"), *(("lowmem", f) for f in args.fetch))]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    try:
        with server:
            for repeat in range(args.repeats):
                for ranks, loader, fetch in cases:
                    row = run(server, scratch, loader, fetch if fetch != "-" else "files", ranks)
                    row["fetch"] = fetch
                    runs[(ranks, loader, fetch)].append(row)
                    ratio = f"  received {row['received_vs_read']:.3f}x of read" if row["received_vs_read"] is not None else ""
                    print(f"  [{repeat + 1}/{args.repeats}] {loader:12s} fetch={fetch:6s} ranks={ranks}  {row['seconds']:6.2f}s  "
                          f"sent {row['bytes'] / 1e9:.2f} GB ({row['bytes'] / size:.2f}x checkpoint)  "
                          f"{row['requests_per_rank']:.0f} requests per rank ({row['weight_gets_per_rank']:.0f} GETs of weight files)"
                          f"{ratio}", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = []
    for case, done in runs.items():
        row = dict(done[-1], seconds=statistics.median(r["seconds"] for r in done), all_seconds=[r["seconds"] for r in done])
        rows.append(row)
    print(f"\nSummary: {args.shape} checkpoint {size / 1e9:.2f} GB -> bf16, server throttled to {args.rate_mb:.0f} MB/s per "
          f"connection, +{args.latency_ms:.0f} ms per request, median of {args.repeats}")
    print("  loader        fetch   ranks  time-to-model  vs transformers  bytes sent / checkpoint  requests per rank  "
          "received / read (max rank)")
    for row in rows:
        base = next(r for r in rows if r["loader"] == "transformers" and r["ranks"] == row["ranks"])
        ratio = f"{row['received_vs_read']:.3f}x" if row["received_vs_read"] is not None else "-"
        print(f"  {row['loader']:12s}  {row['fetch']:6s}  {row['ranks']:5d}  {row['seconds']:12.2f}s  "
              f"{row['seconds'] / base['seconds']:14.2f}x  {row['bytes'] / size:22.2f}x  {row['requests_per_rank']:17.0f}  "
              f"{ratio:>26s}")
    (workdir / "results-hub-latest.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
