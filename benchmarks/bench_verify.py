"""What verifying Hub downloads costs: hashing each downloaded LFS file against the sha256 the Hub publishes.

    python benchmarks/bench_verify.py [--size-gb 2.0] [--repeats 3] [--rate-mb 0] [--latency-ms 0]

On the generated ~2 GB fp32 Llama (sharded safetensors, ``checkpoints.py``) it measures, each in fresh child
processes, alternating so that noise falls on both sides alike:

1. ``hash``: ``lowmem_hf.fetch.cache.file_sha256`` (what a load runs) over every shard, hot in the page cache, as a file is
   right after its download: seconds per GB (1e9 bytes).
2. ``local``: a warm local load of the same folder with lowmem_hf (fp32 -> bf16, files in the page cache), the
   load the hashing is compared with: hashing the whole checkpoint / this load's time.
3. ``hub``: ``from_pretrained("org/bench", fetch="files")`` from the loopback fake Hub (tests/hub_server.py, LFS
   ETags, optionally throttled with ``--rate-mb`` and ``--latency-ms``) into an empty HF cache, with
   ``verify_downloads=True`` and ``False``; the child also reports the seconds spent inside ``file_sha256`` (summed
   over the concurrent downloads, so it overlaps the downloads and exceeds the difference the hashing makes).

Prints medians and the ratios: hashing / warm local load, and hub load with verification / without.
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.append(str(REPO / "tests"))  # after HERE: tests/ has its own checkpoints.py


def child(args) -> int:
    """One measurement in a fresh process; prints ``@@RESULT {json}``."""
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported lazily by any loader: not timed)

    import lowmem_hf
    import lowmem_hf.fetch.cache

    torch.set_num_threads(1)
    if args.child == "hash":
        files = sorted(str(f) for f in Path(args.path).iterdir() if f.suffix == ".safetensors")
        start = time.perf_counter()
        for f in files:
            lowmem_hf.fetch.cache.file_sha256(f)
        result = {"seconds": time.perf_counter() - start, "bytes": sum(os.path.getsize(f) for f in files)}
    else:
        hashing = [0.0]
        real = lowmem_hf.fetch.cache.file_sha256

        def timed(path, **kw):
            t = time.perf_counter()
            try:
                return real(path, **kw)
            finally:
                hashing[0] += time.perf_counter() - t

        lowmem_hf.fetch.cache.file_sha256 = timed
        kwargs = {} if args.child == "local" else {"fetch": "files", "verify_downloads": args.verify == "1"}
        start = time.perf_counter()
        model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(args.path, torch_dtype=torch.bfloat16, **kwargs)
        result = {"seconds": time.perf_counter() - start, "hash_seconds": hashing[0]}
        assert not any(p.device.type == "meta" for p in model.parameters())
    print("@@RESULT " + json.dumps(result), flush=True)
    return 0


def run_child(argv: list[str], env: dict | None = None) -> dict:
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv], env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("@@RESULT "))[9:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rate-mb", type=float, default=0.0, help="server throttle, MB/s per connection (0: none)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="server latency added to every request")
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    parser.add_argument("--child", choices=["hash", "local", "hub"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--verify", default="1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    import torch

    from checkpoints import make_llama_checkpoint, prewarm_page_cache  # noqa: E402
    from hub_server import HubServer  # noqa: E402  (the tests' loopback Hub)

    workdir = Path(args.workdir)
    checkpoint = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    shards = [f for f in Path(checkpoint).iterdir() if f.suffix == ".safetensors"]
    size = sum(f.stat().st_size for f in shards)
    scratch = Path(tempfile.mkdtemp(prefix="bench-verify-", dir=workdir))
    server = HubServer(scratch / "hub", lfs_patterns=HubServer.HF_DEFAULT_LFS_PATTERNS)
    server.add_repo("org/bench", checkpoint, link=True)
    for f in shards:  # the server hashes each file once for its ETag; not in any measurement
        server.file_etag("org/bench", f.name)
    if args.rate_mb:
        server.throttle_bytes_per_s = int(args.rate_mb * 1e6)
    server.latency_s = args.latency_ms / 1e3
    rows: dict[str, list[dict]] = {"hash": [], "local": [], "hub verify": [], "hub no verify": []}
    try:
        with server:
            for repeat in range(args.repeats):
                prewarm_page_cache(checkpoint)
                rows["hash"].append(run_child(["--child", "hash", "--path", str(checkpoint)]))
                rows["local"].append(run_child(["--child", "local", "--path", str(checkpoint)]))
                for verify in ("1", "0") if repeat % 2 == 0 else ("0", "1"):
                    home = scratch / "hf_home"
                    shutil.rmtree(home, ignore_errors=True)
                    result = run_child(["--child", "hub", "--path", "org/bench", "--verify", verify], server.subprocess_env(home))
                    rows["hub verify" if verify == "1" else "hub no verify"].append(result)
                    shutil.rmtree(home, ignore_errors=True)
                print(f"  repeat {repeat + 1}: " + "  ".join(f"{k} {v[-1]['seconds']:.2f}s" for k, v in rows.items()), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def median(name: str, field: str = "seconds") -> float:
        return statistics.median(r[field] for r in rows[name])

    hash_s, local_s = median("hash"), median("local")
    with_s, without_s = median("hub verify"), median("hub no verify")
    in_load = median("hub verify", "hash_seconds")
    print(f"\nCheckpoint: {len(shards)} shards, {size / 1e9:.2f} GB fp32 (-> bf16); medians of {args.repeats}; server "
          + (f"throttled to {args.rate_mb:.0f} MB/s per connection" if args.rate_mb else "unthrottled (loopback)")
          + (f", +{args.latency_ms:.0f} ms per request" if args.latency_ms else ""))
    print(f"  sha256 of the shards, hot in the page cache: {hash_s:.2f} s = {hash_s / (size / 1e9):.2f} s/GB "
          f"({size / 1e9 / hash_s:.2f} GB/s)")
    print(f"  warm local load (lowmem_hf, same folder):   {local_s:.2f} s")
    print(f"  ratio hashing / warm local load:            {hash_s / local_s:.2f}x")
    print(f"  Hub load fetch='files', empty cache:        verify_downloads=True {with_s:.2f} s, False {without_s:.2f} s "
          f"(time inside file_sha256, summed over the concurrent downloads: {in_load:.2f} s)")
    print(f"  ratio Hub load with / without verification: {with_s / without_s:.2f}x (+{with_s - without_s:.2f} s)")
    (workdir / "results-verify-latest.json").write_text(json.dumps({"size": size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
