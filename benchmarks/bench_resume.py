"""Resume and save benchmark: 2 TP ranks resume the generated ~2 GB fp32 Llama from sharded checkpoints as bf16.

    flock /tmp/lowmem-bench.lock python benchmarks/bench_resume.py --size-gb 2.0 --repeats 1 --workdir /tmp/lowmem-resume

Checkpoints (written once into the workdir, fp32): ``dcp-whole`` = ``dcp.save(model.state_dict())`` by one process
(every tensor one stored chunk); ``dcp`` = the same by the 2-rank TP run (``.metadata`` + ``*.distcp``, chunks
matching the ranks' slices); ``sharded`` = transformers' ``save_pretrained(distributed_checkpoint=True)``.

Per rank, as multiples of the rank's local bf16 bytes, above the post-import baseline (measure.py samples
``/proc`` from the parent): peak RssAnon and VmHWM (target <= 1.05x); bytes read by read syscalls (rchar) /
the rank's local bytes at the stored fp32 (target <= 1.02x). Loaders: lowmem_hf from_pretrained; the classic
resume (the TP skeleton on meta, ``to_empty``, ``dcp.load``); transformers' own distributed-checkpoint load.
Save: ``lowmem_hf.save_pretrained`` of the bf16 TP model, peak (local shard + above baseline) / (local shard +
largest full tensor) (target <= 1.05x), gathered and with ``distributed_checkpoint=True``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_load import child_env  # noqa: E402
from checkpoints import make_llama_checkpoint, prewarm_page_cache  # noqa: E402
from measure import boost_sampler_priority, free_port, run_children, spawn_child  # noqa: E402


def run_ranks(mode: str, path: Path, ranks: int, logdir: Path, tag: str, out: Path | None = None) -> list[dict]:
    port = free_port()
    procs, logs = [], []
    for rank in range(ranks):
        env = child_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(logdir / f"resume-{tag}-rank{rank}.stderr.log", "wb")
        logs.append(log)
        argv = [sys.executable, str(HERE / "_resume_child.py"), "--mode", mode, "--path", str(path)]
        if out is not None:
            argv += ["--out", str(out)]
        procs.append(spawn_child(argv, env=env, stderr=log))
    try:
        results = run_children(procs, start_together=True, timeout_s=900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    for rank, r in enumerate(results):
        if not r["ok"]:
            raise SystemExit(f"{tag} rank {rank} failed: {r.get('error')}; see {logdir}")
        res = r["result"]
        r.update(tag=tag, rank=rank, **res)
        if res:
            above_anon = r["peak_rss_anon_above_baseline_kb"] * 1024
            above_hwm = r["vmhwm_above_baseline_kb"] * 1024
            r["rss_anon_ratio"] = above_anon / res["local_bytes"]
            r["vmhwm_ratio"] = above_hwm / res["local_bytes"]
            r["read_ratio"] = res["rchar"] / res["stored_local_bytes"]
            # save: the model is loaded before the baseline, so its local shard comes on top of what was measured
            bound = res["local_bytes"] + res["largest_full_bytes"]
            r["save_ratio"] = (res["local_bytes"] + max(above_anon, above_hwm)) / bound
            r["save_above_largest"] = max(above_anon, above_hwm) / res["largest_full_bytes"]
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", default=str(HERE / "_work"))
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    hub = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    resume = workdir / f"resume-{args.size_gb}-tp{args.ranks}"
    marker = resume / "complete-v2"
    if not marker.exists():
        shutil.rmtree(resume, ignore_errors=True)
        resume.mkdir(parents=True)
        run_ranks("prep", hub, args.ranks, logdir, "prep", out=resume)
        marker.write_text("1")
    print(f"[bench_resume] {args.ranks} ranks, {hub} -> {resume}, sampler {boost_sampler_priority()}")

    loads = [("lowmem", "dcp-whole"), ("dcp", "dcp-whole"), ("lowmem", "dcp"), ("dcp", "dcp"), ("lowmem", "sharded"),
             ("transformers", "sharded")]
    runs = []
    for rep in range(args.repeats):
        for mode, kind in loads:
            prewarm_page_cache(resume / kind)
            for r in run_ranks(mode, resume / kind, args.ranks, logdir, f"{mode}-{kind}-{rep}"):
                r.update(loader=f"{mode} <- {kind}")
                runs.append(r)
                print(f"  [{r['loader']:24s} #{rep} rank {r['rank']}] {r['seconds']:.2f}s  RssAnon +{r['rss_anon_ratio']:.3f}x  "
                      f"VmHWM +{r['vmhwm_ratio']:.3f}x  rchar/local {r['read_ratio']:.3f}  local {r['local_bytes'] / 1e6:.0f} MB")
        for mode in ("save", "save_sharded"):
            out = workdir / f"saved-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            prewarm_page_cache(hub)
            for r in run_ranks(mode, hub, args.ranks, logdir, f"{mode}-{rep}", out=out):
                r.update(loader=mode)
                runs.append(r)
                print(f"  [{mode:24s} #{rep} rank {r['rank']}] {r['seconds']:.2f}s  peak (local + above baseline) / "
                      f"(local + largest full tensor) {r['save_ratio']:.3f}  above baseline / largest {r['save_above_largest']:.2f}")

    med = statistics.median
    print("\nSummary (medians over repeats; memory above the post-import baseline / the rank's local bf16 bytes;"
          " read = rchar / local bytes at the stored fp32)")
    print("  loader                    rank  seconds  RssAnon  VmHWM   read   target: <=1.05, <=1.05, <=1.02")
    for mode, kind in loads:
        for rank in range(args.ranks):
            rs = [r for r in runs if r["loader"] == f"{mode} <- {kind}" and r["rank"] == rank]
            print(f"  {mode + ' <- ' + kind:24s}  {rank:4d}  {med([r['seconds'] for r in rs]):7.2f}  "
                  f"{med([r['rss_anon_ratio'] for r in rs]):7.3f}  {med([r['vmhwm_ratio'] for r in rs]):6.3f}  "
                  f"{med([r['read_ratio'] for r in rs]):5.3f}")
    print("  save                      rank  seconds  peak / (local + largest full tensor)   target <= 1.05")
    for mode in ("save", "save_sharded"):
        for rank in range(args.ranks):
            rs = [r for r in runs if r["loader"] == mode and r["rank"] == rank]
            print(f"  {mode:24s}  {rank:4d}  {med([r['seconds'] for r in rs]):7.2f}  {med([r['save_ratio'] for r in rs]):.3f} "
                  f"(above baseline = {med([r['save_above_largest'] for r in rs]):.2f}x the largest full tensor)")
    out = workdir / "results-resume-latest.json"
    out.write_text(json.dumps([{k: v for k, v in r.items() if k != "result"} for r in runs], indent=1, default=str))
    print(f"[bench_resume] raw results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
