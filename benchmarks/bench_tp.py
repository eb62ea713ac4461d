"""Tensor-parallel load benchmark: 2 ranks load the generated ~2 GB fp32 Llama as bf16, lowmem_hf vs transformers.

    python benchmarks/bench_tp.py [--size-gb 2.0] [--repeats 2] [--ranks 2]

Every rank is a fresh process in one gloo group; the parent samples each rank's /proc status (measure.py)
and prints per rank: wall time, peak RssAnon and VmHWM above the post-import baseline as multiples of the
rank's local model bytes, and bytes read by read syscalls (rchar) against what the rank must read (its
slices at the stored dtype plus replicated tensors plus headers). Targets: memory <= 1.05x, bytes read
<= local + replicated + 1%, wall <= 0.5x transformers. transformers mmaps the shards, so its rchar is not
its I/O: its touched file pages show up in VmHWM instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_load import child_env  # noqa: E402
from checkpoints import make_llama_checkpoint, prewarm_page_cache  # noqa: E402
from measure import boost_sampler_priority, free_port, run_children, spawn_child  # noqa: E402


def run_ranks(loader: str, path: Path, ranks: int, logdir: Path, rep: int) -> list[dict]:
    port = free_port()
    procs, logs = [], []
    for rank in range(ranks):
        env = child_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(logdir / f"tp-{loader}-{rep}-rank{rank}.stderr.log", "wb")
        logs.append(log)
        procs.append(spawn_child([sys.executable, str(HERE / "_tp_child.py"), "--loader", loader, "--path", str(path)],
                                 env=env, stderr=log))
    try:
        results = run_children(procs, start_together=True, timeout_s=600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    for rank, r in enumerate(results):
        if not r["ok"]:
            raise SystemExit(f"{loader} rank {rank} failed: {r.get('error')}; see {logdir}")
        res = r["result"]
        r.update(loader=loader, rank=rank, **{k: res[k] for k in ("load_seconds", "model_bytes", "rchar", "stored_local_bytes", "header_bytes")})
        r["rss_anon_ratio"] = r["peak_rss_anon_above_baseline_kb"] * 1024 / res["model_bytes"]
        r["vmhwm_ratio"] = r["vmhwm_above_baseline_kb"] * 1024 / res["model_bytes"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    path = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    prewarm_page_cache(path)
    print(f"[bench_tp] {args.ranks} ranks, {path}, sampler {boost_sampler_priority()}")

    runs = []
    for rep in range(args.repeats):
        for loader in ("lowmem", "transformers"):
            for r in run_ranks(loader, path, args.ranks, logdir, rep):
                runs.append(r)
                print(f"  [{loader:12s} #{rep} rank {r['rank']}] {r['load_seconds']:.2f}s  RssAnon +{r['rss_anon_ratio']:.3f}x  "
                      f"VmHWM +{r['vmhwm_ratio']:.3f}x  rchar {r['rchar'] / 1e6:.1f} MB  local {r['model_bytes'] / 1e6:.1f} MB")

    print("\nSummary (medians; memory above the post-import baseline as a multiple of the rank's local model bytes)")
    print("  loader        rank  load s  RssAnon/local  VmHWM/local  read MB (rchar)  must read MB  read/must  vs transformers")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    for rank in range(args.ranks):
        t_time = med([r["load_seconds"] for r in runs if r["loader"] == "transformers" and r["rank"] == rank])
        for loader in ("lowmem", "transformers"):
            rs = [r for r in runs if r["loader"] == loader and r["rank"] == rank]
            must = rs[0]["stored_local_bytes"] + (rs[0]["header_bytes"] or 0)
            read = med([r["rchar"] for r in rs])
            ratio = med([r["load_seconds"] for r in rs]) / t_time
            print(f"  {loader:12s}  {rank:4d}  {med([r['load_seconds'] for r in rs]):6.2f}  {med([r['rss_anon_ratio'] for r in rs]):13.3f}  "
                  f"{med([r['vmhwm_ratio'] for r in rs]):11.3f}  {read / 1e6:15.1f}  {must / 1e6:12.1f}  {read / must:9.3f}  "
                  + (f"{ratio:.2f}x" if loader == "lowmem" else ""))
    out = workdir / "results-tp-latest.json"
    out.write_text(json.dumps([{k: v for k, v in r.items() if k != "result"} for r in runs], indent=1, default=str))
    print(f"[bench_tp] raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
