"""DistributedConfig mesh load benchmark: FSDP 2 ranks, HSDP 2x2, TP2 x FSDP2 on the generated ~2 GB fp32 Llama
loaded as bf16, lowmem_hf vs transformers' ``from_pretrained(distributed_config=...)``.

    flock /tmp/lowmem-bench.lock python benchmarks/bench_mesh.py [--size-gb 2.0] [--repeats 1] [--meshes fsdp2 hsdp2x2 tp2xfsdp2]

Every rank is a fresh process in one gloo group; the parent samples each rank's /proc status (measure.py)
and prints per rank and as a node total: wall time, peak RssAnon and VmHWM above the post-import baseline
as multiples of the rank's local model bytes, and bytes read by read syscalls (rchar) against what the rank
must read (its shards at the stored dtype plus headers). Target: memory <= 1.05x per rank.
Before the baseline each child loads a tiny Llama once with the same loader and mesh (``--no-warmup`` skips it):
the code pages and allocator arenas a process touches the first time it runs DTensor/FSDP2 code (~9 MB of
RssFile here) are a once-per-process cost, not a multiple of the model. transformers mmaps
the shards, so its rchar is not its I/O: its touched file pages show up in VmHWM instead.
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


MESHES = {
    "fsdp2": {"fsdp_size": 2},
    "hsdp2x2": {"dp_replicate_size": 2, "fsdp_size": 2},
    "tp2xfsdp2": {"tp_size": 2, "fsdp_size": 2},
}


def make_warmup_checkpoint(workdir: Path) -> Path:
    """A tiny Llama with the benchmark model's head counts (so every mesh divides it) for the children's warm-up load."""
    import transformers

    path = workdir / "llama-warmup-tiny"
    if not (path / "config.json").exists():
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=4, tie_word_embeddings=False)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def run_ranks(loader: str, path: Path, mesh: str, logdir: Path, rep: int, warmup: Path | None = None) -> list[dict]:
    sizes = MESHES[mesh]
    ranks = 1
    for v in sizes.values():
        ranks *= v
    flags = [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    port = free_port()
    procs, logs = [], []
    for rank in range(ranks):
        env = child_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(logdir / f"mesh-{mesh}-{loader}-{rep}-rank{rank}.stderr.log", "wb")
        logs.append(log)
        procs.append(spawn_child([sys.executable, str(HERE / "_mesh_child.py"), "--loader", loader, "--path", str(path), *flags,
                                  *(["--warmup", str(warmup)] if warmup else [])],
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
        r.update(loader=loader, rank=rank, mesh=mesh, **{k: res[k] for k in ("load_seconds", "model_bytes", "rchar", "stored_local_bytes", "header_bytes")})
        r["rss_anon_ratio"] = r["peak_rss_anon_above_baseline_kb"] * 1024 / res["model_bytes"]
        r["vmhwm_ratio"] = r["vmhwm_above_baseline_kb"] * 1024 / res["model_bytes"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--meshes", nargs="+", choices=sorted(MESHES), default=list(MESHES))
    parser.add_argument("--loaders", nargs="+", choices=["lowmem", "transformers"], default=["lowmem", "transformers"])
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    parser.add_argument("--no-warmup", action="store_true", help="measure the first distributed load of each process")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    path = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    prewarm_page_cache(path)
    warmup = None if args.no_warmup else make_warmup_checkpoint(workdir)
    print(f"[bench_mesh] {path}, warm-up load {warmup}, sampler {boost_sampler_priority()}")

    runs = []
    for mesh in args.meshes:
        for rep in range(args.repeats):
            for loader in args.loaders:
                for r in run_ranks(loader, path, mesh, logdir, rep, warmup):
                    runs.append(r)
                    print(f"  [{mesh} {loader:12s} #{rep} rank {r['rank']}] {r['load_seconds']:.2f}s  RssAnon +{r['rss_anon_ratio']:.3f}x  "
                          f"VmHWM +{r['vmhwm_ratio']:.3f}x  rchar {r['rchar'] / 1e6:.1f} MB  local {r['model_bytes'] / 1e6:.1f} MB", flush=True)

    print("\nSummary (medians over repeats; memory above each rank's post-import baseline as a multiple of its local model bytes)")
    print("  mesh        loader        rank  load s  RssAnon/local  VmHWM/local  read MB (rchar)  must read MB  read/must")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    for mesh in args.meshes:
        ranks = sorted({r["rank"] for r in runs if r["mesh"] == mesh})
        for loader in args.loaders:
            totals = {"anon": 0.0, "hwm": 0.0, "local": 0.0, "read": 0.0, "must": 0.0, "time": 0.0}
            for rank in ranks:
                rs = [r for r in runs if r["loader"] == loader and r["rank"] == rank and r["mesh"] == mesh]
                must = rs[0]["stored_local_bytes"] + (rs[0]["header_bytes"] or 0)
                read = med([r["rchar"] for r in rs])
                t = med([r["load_seconds"] for r in rs])
                anon, hwm = med([r["rss_anon_ratio"] for r in rs]), med([r["vmhwm_ratio"] for r in rs])
                local = rs[0]["model_bytes"]
                totals.update(anon=totals["anon"] + anon * local, hwm=totals["hwm"] + hwm * local, local=totals["local"] + local,
                              read=totals["read"] + read, must=totals["must"] + must, time=max(totals["time"], t))
                print(f"  {mesh:10s}  {loader:12s}  {rank:4d}  {t:6.2f}  {anon:13.3f}  {hwm:11.3f}  {read / 1e6:15.1f}  {must / 1e6:12.1f}  {read / must:9.3f}")
            print(f"  {mesh:10s}  {loader:12s}  node  {totals['time']:6.2f}  {totals['anon'] / totals['local']:13.3f}  "
                  f"{totals['hwm'] / totals['local']:11.3f}  {totals['read'] / 1e6:15.1f}  {totals['must'] / 1e6:12.1f}  {totals['read'] / totals['must']:9.3f}")
    out = workdir / "results-mesh-latest.json"
    out.write_text(json.dumps([{k: v for k, v in r.items() if k != "result"} for r in runs], indent=1, default=str))
    print(f"[bench_mesh] raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
