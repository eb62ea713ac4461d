"""Time to a usable model, lowmem_hf vs transformers, warm and cold page cache, 1 process and 2 TP ranks.

    python benchmarks/bench_usable.py [--size-gb 2.0] [--repeats 3] [--ranks 1 2] [--cache warm cold] [--against REV]

For each case (fp32 safetensors -> bf16, fp32 .bin -> bf16, fp32 -> fp32 owned, fp32 -> fp32 ``mmap=True`` (one
process only: with TP, dim-1 slices cannot be views and ``mmap=True`` refuses them)),
each loader runs in a fresh child (``_usable_child.py``), alternating loaders within each repeat so they share
the machine's noise. Reported: seconds to ``from_pretrained`` return, to the end of a first forward, and to
the end of a first in-place write of every parameter, all from one clock; peak RssAnon and VmHWM above the
post-import baseline (parent-sampled over the whole sequence) / the final model bytes. Cold: ``sync; echo 3 >
/proc/sys/vm/drop_caches`` before every load (root only; the run says when it cannot and stays warm). Ratios
are lowmem medians / transformers medians of the same run, and "won" counts the repeats in which lowmem_hf returned
no later than transformers (the two are close enough warm that one run's medians can land either side). One process also runs ``bare`` (``_usable_child.py``):
every tensor read and converted into fresh memory with no model at all, what that alone takes on this
machine; the summary gives both loaders' return times as multiples of it. ``--against REV`` adds a loader
``lowmem@REV``: the repository's ``lowmem_hf`` at git revision REV (extracted into the workdir), alternating with
the others in the same run, to measure a change against what it replaces. Exit status 1 only if a child failed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_load import child_env  # noqa: E402
from checkpoints import drop_page_cache, make_bin_twin, make_llama_checkpoint, prewarm_page_cache  # noqa: E402
from measure import boost_sampler_priority, free_port, run_children, spawn_child  # noqa: E402

# case -> (checkpoint format, target dtype, loaders compared with transformers)
CASES = {
    "fp32_st_to_bf16": ("safetensors", "bfloat16", ("lowmem",)),
    "fp32_bin_to_bf16": ("bin", "bfloat16", ("lowmem",)),
    "fp32_st_to_fp32": ("safetensors", "float32", ("lowmem", "lowmem-mmap")),
}
STAGES = ("load_seconds", "forward_seconds", "write_seconds")


def run(loader: str, path: Path, dtype: str, ranks: int, logdir: Path, tag: str) -> list[dict]:
    port, procs, logs = free_port(), [], []
    for rank in range(ranks):
        env = child_env()
        if ranks > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        log = open(logdir / f"usable-{tag}-{loader}-rank{rank}.stderr.log", "wb")
        logs.append(log)
        base, _, rev = loader.partition("@")
        argv = [sys.executable, str(HERE / "_usable_child.py"), "--loader", base, "--path", str(path), "--dtype", dtype]
        if rev:
            argv += ["--package-dir", str(logdir.parent / f"rev-{rev}")]
        procs.append(spawn_child(argv, env=env, stderr=log))
    try:
        results = run_children(procs, start_together=True, timeout_s=900)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    out = []
    for rank, r in enumerate(results):
        if not r["ok"]:
            raise RuntimeError(f"{loader} rank {rank} failed: {r.get('error')}; see {logdir}")
        res = r["result"]
        mb = res["model_bytes"]
        res.update(rss_anon=r["peak_rss_anon_above_baseline_kb"] * 1024 / mb, vmhwm=r["vmhwm_above_baseline_kb"] * 1024 / mb)
        out.append(res)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cache", nargs="+", choices=("warm", "cold"), default=["warm", "cold"])
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--workdir", default=str(HERE / "_work"))
    ap.add_argument("--against", metavar="REV", help="also time lowmem_hf as of this git revision (lowmem@REV)")
    args = ap.parse_args(argv)

    workdir = Path(args.workdir).resolve()
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    st = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    paths = {"safetensors": st}
    if any(CASES[c][0] == "bin" for c in args.cases):
        paths["bin"] = make_bin_twin(st, workdir / (st.name + "-bin"))
    caches = list(args.cache)
    if "cold" in caches and not drop_page_cache():
        print("[usable] cannot drop the page cache here (needs root and a writable /proc/sys/vm/drop_caches): "
              "cold runs skipped", flush=True)
        caches.remove("cold")
    print(f"[usable] sampler {boost_sampler_priority()}; checkpoint {st}", flush=True)
    against = extract_revision(args.against, workdir) if args.against else None

    rows = []
    for ranks in args.ranks:
        for case in args.cases:
            fmt, dtype, ours = CASES[case]
            if against is not None:
                ours = (*ours, f"lowmem@{against}")
            if ranks > 1 and "lowmem-mmap" in ours:  # TP slices along dim 1 cannot be views: mmap=True refuses them
                print(f"[usable] {ranks} ranks: no mmap=True row (llama's TP plan slices o_proj/down_proj along dim 1)", flush=True)
                ours = tuple(loader for loader in ours if loader != "lowmem-mmap")
            loaders = (*ours, "transformers") + (("bare",) if ranks == 1 else ())
            for cache in caches:
                runs: dict[str, list[dict]] = {loader: [] for loader in loaders}
                for rep in range(args.repeats):
                    for loader in loaders:
                        if cache == "cold":
                            drop_page_cache()
                        else:
                            prewarm_page_cache(paths[fmt])
                        got = run(loader, paths[fmt], dtype, ranks, logdir, f"{case}-{cache}-{ranks}-{rep}")
                        slowest = max(got, key=lambda r: r["write_seconds"])  # the job waits for its slowest rank
                        slowest.update(rss_anon=max(r["rss_anon"] for r in got), vmhwm=max(r["vmhwm"] for r in got))
                        runs[loader].append(slowest)
                        print(f"  [{ranks} rank(s) {case} {cache} {loader:<15} #{rep}] "
                              + "  ".join(f"{s.split('_')[0]} {slowest[s]:.2f}s" for s in STAGES if slowest[s] is not None)
                              + f"  RssAnon {slowest['rss_anon']:.3f}x  VmHWM {slowest['vmhwm']:.3f}x", flush=True)
                med = {loader: {k: statistics.median(r[k] for r in rs) for k in (*STAGES, "rss_anon", "vmhwm") if rs[0][k] is not None}
                       for loader, rs in runs.items()}
                for loader in ours:
                    # the noise check: in how many repeats this loader returned no later than transformers did
                    won = sum(a["load_seconds"] <= b["load_seconds"] for a, b in zip(runs[loader], runs["transformers"]))
                    rows.append((ranks, case, cache, loader, med[loader], med["transformers"], med.get("bare"), won))

    print(f"\nSummary: medians of {args.repeats}; time ratio = lowmem / transformers in the same run; memory = peak "
          "above baseline / model bytes (per rank, the worst rank); bare = seconds to read and convert every tensor "
          "with no model (one process only), and each loader's return time as a multiple of it; won = repeats in which "
          "the loader returned no later than transformers did in the same repeat")
    print(f"{'ranks':>5} {'case':<17} {'cache':<5} {'loader':<15} {'return':>14} {'first forward':>14} "
          f"{'first write':>14} {'won':>5} {'RssAnon':>8} {'VmHWM':>8} {'tf VmHWM':>9} {'bare':>7} {'ours/bare':>9} {'tf/bare':>7}")
    for ranks, case, cache, loader, m, tf, bare, won in rows:
        cells = "".join(f"{m[s]:>7.2f}s {m[s] / tf[s]:>5.2f}x" for s in STAGES)
        floor = "" if bare is None else (f" {bare['load_seconds']:>6.2f}s {m['load_seconds'] / bare['load_seconds']:>8.2f}x "
                                          f"{tf['load_seconds'] / bare['load_seconds']:>6.2f}x")
        print(f"{ranks:>5} {case:<17} {cache:<5} {loader:<15} {cells} {f'{won}/{args.repeats}':>5} {m['rss_anon']:>7.3f}x {m['vmhwm']:>7.3f}x "
              f"{tf['vmhwm']:>8.3f}x{floor}")
    return 0


def extract_revision(rev: str, workdir: Path) -> str:
    """``git archive`` the package at ``rev`` into ``workdir/rev-<sha>/lowmem_rev``; return the short sha."""
    repo = HERE.parent
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", rev], check=True, capture_output=True, text=True).stdout.strip()
    target = workdir / f"rev-{sha}"
    if not (target / "lowmem_rev").is_dir():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(repo), "archive", sha, "lowmem_hf"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
        (target / "lowmem_hf").rename(target / "lowmem_rev")  # its own name: the installed lowmem_hf would be imported
    print(f"[usable] lowmem@{sha}: lowmem_hf as of {rev} ({target / 'lowmem_rev'})", flush=True)
    return sha


if __name__ == "__main__":
    sys.exit(main())
