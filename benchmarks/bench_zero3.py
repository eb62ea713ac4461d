"""DeepSpeed ZeRO-3 load benchmark: 2 and 4 ranks load the generated ~2 GB fp32 Llama as bf16 partitions,
lowmem_hf against transformers under the same ZeRO-3 config.

    flock -x /tmp/lowmem-bench.lock python benchmarks/bench_zero3.py [--ranks 2 4] [--repeats 2] [--workdir /tmp/lowmem-bl]

Every rank is a fresh process (``_zero3_child.py``) in one gloo group made by ``deepspeed.init_distributed``, with
``DS_ACCELERATOR=cpu`` and ``HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
...})`` alive; both loaders get ``dtype=torch.bfloat16``. The parent samples each rank's /proc status (measure.py)
and prints, per rank and as a node total: time to model (``from_pretrained`` in the child), peak RssAnon and
VmHWM above the post-import baseline as multiples of the rank's partition bytes (sum of ``p.ds_tensor.numel() *
element_size`` over the parameters, padding included), and bytes read by read syscalls (rchar) against what the
rank must read (its partitions' elements at the stored fp32, plus buffers and headers).

Targets (the issue's): memory <= 1.05x the partition bytes per rank, RssAnon and VmHWM; time <= 0.5x
transformers' at 2 and at 4 ranks (the node's time is its slowest rank's); each rank reads <= 1.02x its
partitions at the stored dtype plus buffers and headers. transformers reads the checkpoint through a file mapping
on rank 0 (``map_location="meta"`` on the others), so its rchar is not its I/O: the touched file pages show in
rank 0's VmHWM.

DeepSpeed on CPU JIT-builds its shm communication op in ``deepspeed.init_distributed`` (before the baseline, never
timed); the children build it once into ``<workdir>/torch_extensions`` (``TORCH_EXTENSIONS_DIR``), so other jobs
sharing ``~/.cache/torch_extensions`` with another torch cannot make every child rebuild it.

A third loader, ``build``, only constructs the model under transformers' ZeRO-3 init context (``deepspeed.zero.Init``,
as both loaders do before reading anything) and reads nothing: the time and memory both loaders pay for the
skeleton. Under zero.Init every new parameter is materialized whole on every rank, broadcast from rank 0 (its
uninitialized values) and then partitioned. ``--no-init-broadcast`` (an experiment, for every loader) patches
DeepSpeed in the children to partition without that broadcast; every partition is then written by the load.

Before the baseline each child loads a tiny Llama once with the same loader and config (``--no-warmup`` skips
it), as bench_mesh.py does. Loaders alternate within each repeat (the order reversed every other repeat); the
summary prints medians, and the lowmem/transformers time ratio of each repeat (the two ran next to each other).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_load import child_env  # noqa: E402
from bench_mesh import make_warmup_checkpoint  # noqa: E402
from checkpoints import make_llama_checkpoint, prewarm_page_cache  # noqa: E402
from measure import boost_sampler_priority, free_port, run_children, spawn_child  # noqa: E402

LOADERS = ("lowmem", "transformers", "build")
MEM_TARGET, TIME_TARGET, READ_TARGET = 1.05, 0.5, 1.02


def run_ranks(loader: str, path: Path, ranks: int, logdir: Path, rep: int, warmup: Path | None, timeout: float,
              profile: bool, extensions: Path, no_init_broadcast: bool) -> list[dict]:
    port = free_port()
    procs, logs = [], []
    for rank in range(ranks):
        env = child_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                   TORCH_EXTENSIONS_DIR=str(extensions))
        log = open(logdir / f"zero3-{ranks}-{loader}-{rep}-rank{rank}.stderr.log", "wb")
        logs.append(log)
        argv = [sys.executable, str(HERE / "_zero3_child.py"), "--loader", loader, "--path", str(path)]
        if warmup:
            argv += ["--warmup", str(warmup)]
        if no_init_broadcast:
            argv.append("--no-init-broadcast")
        if profile:
            argv += ["--profile", str(logdir / f"zero3-{ranks}-{loader}-{rep}-rank{rank}.prof")]
        procs.append(spawn_child(argv, env=env, stderr=log))
    try:
        results = run_children(procs, start_together=True, timeout_s=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    for rank, r in enumerate(results):
        if not r["ok"]:
            raise SystemExit(f"{loader} {ranks} ranks, rank {rank} failed: {r.get('error')}; see {logdir}")
        res = r["result"]
        r.update(loader=loader, rank=rank, ranks=ranks, rep=rep, **{k: res[k] for k in (
            "load_seconds", "rchar", "partition_bytes", "stored_partition_bytes", "buffer_bytes", "header_bytes",
            "report_bytes_read", "values_ok", "partition_dtypes")})
        r["anon_bytes"] = r["peak_rss_anon_above_baseline_kb"] * 1024
        r["hwm_bytes"] = r["vmhwm_above_baseline_kb"] * 1024
        r["file_bytes"] = r["peak_rss_file_above_baseline_kb"] * 1024
        r["must_read"] = res["stored_partition_bytes"] + res["buffer_bytes"] + (res["header_bytes"] or 0)
        r["read_budget"] = READ_TARGET * res["stored_partition_bytes"] + res["buffer_bytes"] + (res["header_bytes"] or 0)
    if results:
        results[0]["group_anon_bytes"] = results[0].get("group", {}).get("peak_sum_rss_anon_above_baseline_kb", 0) * 1024
    return results


def fmt_mb(n) -> str:
    return "" if n is None else f"{n / 1e6:.1f}"


def fmt_ok(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def summarize(runs: list[dict], ranks_list: list[int], loaders) -> list[str]:
    med = statistics.median
    lines = []
    for ranks in ranks_list:
        lines.append(f"\n{ranks} ranks (medians over repeats; memory above each rank's post-import baseline / its partition bytes)")
        lines.append("  loader        rank  time s  partition MB  RssAnon/part  VmHWM/part  RssFile MB  rchar MB  report MB  must read MB  read/must  values")
        node_time, node_mem, rep_time = {}, {}, {}
        for loader in loaders:
            rows = [r for r in runs if r["ranks"] == ranks and r["loader"] == loader]
            if not rows:
                continue
            tot = dict(anon=0.0, hwm=0.0, part=0.0, file=0.0, read=0.0, must=0.0, report=0.0)
            worst_anon = worst_hwm = 0.0
            read_ok = True
            for rank in range(ranks):
                rs = [r for r in rows if r["rank"] == rank]
                part = rs[0]["partition_bytes"]
                t = med([r["load_seconds"] for r in rs])
                anon, hwm = med([r["anon_bytes"] for r in rs]), med([r["hwm_bytes"] for r in rs])
                fil, read = med([r["file_bytes"] for r in rs]), med([r["rchar"] for r in rs])
                must, budget = rs[0]["must_read"], rs[0]["read_budget"]
                rep_read = med([r["report_bytes_read"] for r in rs]) if rs[0]["report_bytes_read"] is not None else None
                worst_anon, worst_hwm = max(worst_anon, anon / part), max(worst_hwm, hwm / part)
                read_ok &= read <= budget
                values = "n/a" if rs[0]["values_ok"] is None else "ok" if all(r["values_ok"] for r in rs) else "WRONG"
                tot.update(anon=tot["anon"] + anon, hwm=tot["hwm"] + hwm, part=tot["part"] + part, file=tot["file"] + fil,
                           read=tot["read"] + read, must=tot["must"] + must, report=tot["report"] + (rep_read or 0))
                lines.append(f"  {loader:12s}  {rank:4d}  {t:6.2f}  {part / 1e6:12.1f}  {anon / part:12.3f}  {hwm / part:10.3f}  "
                             f"{fil / 1e6:10.1f}  {read / 1e6:8.1f}  {fmt_mb(rep_read):>9s}  {must / 1e6:12.1f}  {read / must:9.3f}  {values}")
            # the node: the job has its model when its slowest rank has it; memory summed over the ranks
            per_rep: dict[int, list[float]] = {}
            for r in rows:
                per_rep.setdefault(r["rep"], []).append(r["load_seconds"])
            rep_time[loader] = {rep: max(ts) for rep, ts in per_rep.items()}
            node_time[loader] = med(list(rep_time[loader].values()))
            group = med([r["group_anon_bytes"] for r in rows if "group_anon_bytes" in r])
            node_mem[loader] = (worst_anon, worst_hwm, read_ok)
            lines.append(f"  {loader:12s}  node  {node_time[loader]:6.2f}  {tot['part'] / 1e6:12.1f}  {tot['anon'] / tot['part']:12.3f}  "
                         f"{tot['hwm'] / tot['part']:10.3f}  {tot['file'] / 1e6:10.1f}  {tot['read'] / 1e6:8.1f}  "
                         f"{fmt_mb(tot['report'] or None):>9s}  {tot['must'] / 1e6:12.1f}  {tot['read'] / tot['must']:9.3f}  "
                         f"(simultaneous RssAnon {group / tot['part']:.3f}x)")
        if "lowmem" in node_time and "transformers" in node_time:
            ratio = node_time["lowmem"] / node_time["transformers"]
            pairs = [rep_time["lowmem"][rep] / rep_time["transformers"][rep]
                     for rep in sorted(rep_time["lowmem"]) if rep in rep_time["transformers"]]
            anon, hwm, read_ok = node_mem["lowmem"]
            tf_anon, tf_hwm, _ = node_mem["transformers"]
            lines.append(f"  time to model (slowest rank): lowmem {node_time['lowmem']:.2f} s, transformers "
                         f"{node_time['transformers']:.2f} s: {ratio:.2f}x (target <= {TIME_TARGET}x) {fmt_ok(ratio <= TIME_TARGET)}; "
                         f"per repeat {', '.join(f'{x:.2f}x' for x in pairs)}")
            if "build" in node_time:
                lines.append(f"  of which building under zero.Init (the 'build' rows, both loaders pay it): {node_time['build']:.2f} s")
            lines.append(f"  memory, worst rank: lowmem RssAnon {anon:.3f}x, VmHWM {hwm:.3f}x (target <= {MEM_TARGET}x) "
                         f"{fmt_ok(anon <= MEM_TARGET and hwm <= MEM_TARGET)}; transformers RssAnon {tf_anon:.3f}x, VmHWM {tf_hwm:.3f}x"
                         + (f"; build alone RssAnon {node_mem['build'][0]:.3f}x, VmHWM {node_mem['build'][1]:.3f}x" if "build" in node_mem else ""))
            lines.append(f"  reads: every lowmem rank <= {READ_TARGET}x its partitions at fp32 + buffers + headers: {fmt_ok(read_ok)}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--loaders", nargs="+", choices=LOADERS, default=list(LOADERS))
    parser.add_argument("--workdir", default="/tmp/lowmem-bl")
    parser.add_argument("--no-warmup", action="store_true", help="measure the first ZeRO-3 load of each process")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per group of ranks")
    parser.add_argument("--profile", action="store_true", help="cProfile each measured load (<workdir>/logs/*.prof)")
    parser.add_argument("--no-init-broadcast", action="store_true",
                        help="experiment, for every loader: DeepSpeed's zero.Init partitions each new parameter without "
                             "first broadcasting rank 0's uninitialized values (a patch of DeepSpeed in the child)")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    path = make_llama_checkpoint(workdir, args.size_gb, torch.float32)
    prewarm_page_cache(path)
    warmup = None if args.no_warmup else make_warmup_checkpoint(workdir)
    print(f"[bench_zero3] {path}, ranks {args.ranks}, warm-up load {warmup}, "
          f"zero.Init broadcast {'OFF (experiment)' if args.no_init_broadcast else 'on'}, sampler {boost_sampler_priority()}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    runs = []
    t0 = time.monotonic()
    for ranks in args.ranks:
        for rep in range(args.repeats):
            order = list(args.loaders) if rep % 2 == 0 else list(reversed(args.loaders))
            for loader in order:
                for r in run_ranks(loader, path, ranks, logdir, rep, warmup, args.timeout, args.profile,
                                   workdir / "torch_extensions", args.no_init_broadcast):
                    runs.append(r)
                    print(f"  [{ranks} ranks {loader:12s} #{rep} rank {r['rank']}] {r['load_seconds']:.2f}s  "
                          f"RssAnon +{r['anon_bytes'] / r['partition_bytes']:.3f}x  VmHWM +{r['hwm_bytes'] / r['partition_bytes']:.3f}x  "
                          f"rchar {r['rchar'] / 1e6:.1f} MB  partition {r['partition_bytes'] / 1e6:.1f} MB "
                          f"{'/'.join(r['partition_dtypes'])}  values {'n/a' if r['values_ok'] is None else 'ok' if r['values_ok'] else 'WRONG'}"
                          + (f"  report.bytes_read {r['report_bytes_read'] / 1e6:.1f} MB" if r["report_bytes_read"] else ""),
                          flush=True)

    lines = summarize(runs, args.ranks, args.loaders)
    print("\n".join(lines))
    print(f"\n[bench_zero3] {time.monotonic() - t0:.0f} s of loads, load average now {os.getloadavg()[0]:.2f}")
    out = workdir / "results-zero3-latest.json"
    out.write_text(json.dumps(runs, indent=1, default=str))
    print(f"[bench_zero3] raw results: {out}")
    return 0 if all(r["values_ok"] is not False for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
