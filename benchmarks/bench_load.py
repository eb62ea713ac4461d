"""Load-time / peak-memory benchmark: lowmem_hf vs transformers.from_pretrained.

    python benchmarks/bench_load.py [--size-gb 2.0] [--repeats 2] [--workdir benchmarks/_work]
                                    [--cases fp32_st_to_bf16 ...] [--loaders lowmem transformers]

Every load runs in a fresh child process (benchmarks/_child.py) measured from this parent
process (benchmarks/measure.py); see benchmarks/README.md for what the numbers mean.
Exit status: 0 when every child ran (whether or not the targets are met), 1 if any crashed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from checkpoints import (  # noqa: E402
    drop_page_cache,
    make_bin_twin,
    make_llama_checkpoint,
    prewarm_page_cache,
)
from measure import boost_sampler_priority, run_child  # noqa: E402

# case name -> (checkpoint source dtype, format, target dtype, description)
CASES = {
    "fp32_st_to_bf16": ("float32", "safetensors", "bfloat16", "(a) fp32 safetensors -> bf16"),
    "fp32_bin_to_bf16": ("float32", "bin", "bfloat16", "(b) fp32 .bin -> bf16"),
    "bf16_st_to_bf16": ("bfloat16", "safetensors", "bfloat16", "(c) bf16 safetensors -> bf16"),
    "fp32_st_to_fp32": ("float32", "safetensors", "float32", "(d) fp32 safetensors -> fp32"),
}
ALIASES = {"a": "fp32_st_to_bf16", "b": "fp32_bin_to_bf16", "c": "bf16_st_to_bf16", "d": "fp32_st_to_fp32"}
LOADERS = ("lowmem", "transformers", "accelerate")
DEFAULT_LOADERS = ("lowmem", "transformers")

# Targets for lowmem_hf (see README): memory above the post-import baseline at most 1.05x the
# final model bytes, and at most half of transformers' wall time.
TARGET_MEM_RATIO = 1.05
TARGET_TIME_RATIO = 0.5


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size in fp32 (GB, 1e9 bytes)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per loader per case")
    ap.add_argument("--workdir", default=str(HERE / "_work"), help="checkpoint cache + results")
    ap.add_argument(
        "--cases", nargs="+", default=list(CASES), metavar="CASE",
        help=f"subset of {list(CASES)} (or a b c d)",
    )
    ap.add_argument("--loaders", nargs="+", default=list(DEFAULT_LOADERS), choices=LOADERS,
                    help="loaders to run, alternated in this order (accelerate: init_empty_weights + "
                         "load_checkpoint_and_dispatch, its big-model recipe)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before every load (cold reads; needs root). "
                         "Default: the checkpoint is read once up front so all loads are warm.")
    ap.add_argument("--interval-ms", type=float, default=2.0, help="parent sampling period")
    ap.add_argument("--no-rt-sampler", action="store_true",
                    help="do not try to run the sampling parent with real-time priority")
    ap.add_argument("--timeout", type=float, default=900.0, help="per-child timeout (s)")
    ap.add_argument("--skip-value-check", action="store_true",
                    help="do not verify the loaded values against the generator's fingerprints")
    args = ap.parse_args(argv)
    cases = []
    for c in args.cases:
        c = ALIASES.get(c, c)
        if c not in CASES:
            ap.error(f"unknown case {c!r}; choose from {list(CASES)} or a b c d")
        cases.append(c)
    args.cases = cases
    return args


def prepare_checkpoints(workdir: Path, size_gb: float, cases) -> dict[tuple[str, str], Path]:
    """Generate (or reuse) the checkpoints the selected cases need: {(dtype, format): dir}."""
    import torch

    paths: dict[tuple[str, str], Path] = {}
    for case in cases:
        src_dtype, fmt, _, _ = CASES[case]
        if (src_dtype, fmt) in paths:
            continue
        st = make_llama_checkpoint(workdir, size_gb, getattr(torch, src_dtype))
        paths[(src_dtype, "safetensors")] = st
        if fmt == "bin":
            paths[(src_dtype, "bin")] = make_bin_twin(st, st.with_name(st.name + "-bin"))
    return paths


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Import the working tree's lowmem_hf (and the sibling helper modules) in the child.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    # Local paths only: never let a hub lookup (and its network timeouts) into the timing.
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_one(case: str, loader: str, path: Path, rep: int, args, logdir: Path) -> dict:
    _, _, target, _ = CASES[case]
    argv = [sys.executable, str(HERE / "_child.py"), "--loader", loader, "--path", str(path), "--dtype", target]
    if args.skip_value_check:
        argv.append("--skip-value-check")
    log = logdir / f"{case}-{loader}-{rep}.stderr.log"
    with open(log, "wb") as err:
        r = run_child(argv, env=child_env(), stderr=err, interval_s=args.interval_ms / 1e3,
                      timeout_s=args.timeout)
    r.update(case=case, loader=loader, repeat=rep, stderr_log=str(log))
    res = r.get("result") or {}
    if r["ok"]:
        mb = res["model_bytes"]
        r["load_seconds"] = res["load_seconds"]
        r["model_bytes"] = mb
        r["rss_anon_ratio"] = r["peak_rss_anon_above_baseline_kb"] * 1024 / mb
        r["vmhwm_ratio"] = r["vmhwm_above_baseline_kb"] * 1024 / mb
        bad = []
        if res.get("n_meta_tensors"):
            bad.append(f"{res['n_meta_tensors']} tensors on meta")
        if not res.get("dtype_ok"):
            bad.append(f"param dtypes {res.get('param_dtypes')}")
        if res.get("values_ok") is False:
            bad.append(f"{res.get('n_values_mismatch')} tensors with wrong values "
                       f"{res.get('values_mismatch', [])[:3]}")
        r["problems"] = bad
    else:
        try:
            tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        except OSError:
            tail = []
        r["stderr_tail"] = tail
    return r


def fmt_run(r: dict) -> str:
    if not r["ok"]:
        return f"CRASHED: {r['error']}"
    res = r["result"]
    s = (f"{r['load_seconds']:7.2f}s  RssAnon +{r['rss_anon_ratio']:.3f}x  VmHWM +{r['vmhwm_ratio']:.3f}x"
         f"  RssFile peak +{r['peak_rss_file_above_baseline_kb'] / 1024:.0f}MB"
         f"  file-backed params {res['file_backed_param_bytes'] / 2**20:.0f}MB"
         f"  values {'ok' if res.get('values_ok') else res.get('values_ok', 'unchecked')}")
    if r["problems"]:
        s += "  PROBLEMS: " + "; ".join(r["problems"])
    return s


def summarize(case: str, runs: list[dict]) -> dict:
    """Medians per loader + lowmem targets for one case."""
    out: dict = {"case": case, "description": CASES[case][3], "loaders": {}}
    for loader in LOADERS:
        ok = [r for r in runs if r["loader"] == loader and r["ok"]]
        n_all = sum(r["loader"] == loader for r in runs)
        if not n_all:
            continue
        s = {"runs": len(ok), "crashed": n_all - len(ok)}
        if ok:
            s.update(
                load_seconds=statistics.median(r["load_seconds"] for r in ok),
                rss_anon_ratio=statistics.median(r["rss_anon_ratio"] for r in ok),
                vmhwm_ratio=statistics.median(r["vmhwm_ratio"] for r in ok),
                model_bytes=ok[0]["model_bytes"],
                rss_file_after_mb=statistics.median(
                    (r["result"]["rss_file_after_kb"] - r["baseline"]["RssFile"]) / 1024 for r in ok),
                file_backed_param_mb=statistics.median(r["result"]["file_backed_param_bytes"] / 2**20 for r in ok),
                correct=all(not r["problems"] for r in ok),
            )
        out["loaders"][loader] = s
    lm, tf = out["loaders"].get("lowmem", {}), out["loaders"].get("transformers", {})
    if "load_seconds" in lm and "load_seconds" in tf:
        out["time_ratio"] = lm["load_seconds"] / tf["load_seconds"]
    for s in out["loaders"].values():
        if "load_seconds" in s and "load_seconds" in tf:
            s["time_vs_transformers"] = s["load_seconds"] / tf["load_seconds"]
    if "load_seconds" in lm:
        out["targets"] = {
            f"RssAnon <= {TARGET_MEM_RATIO}x model": lm["rss_anon_ratio"] <= TARGET_MEM_RATIO,
            f"VmHWM <= {TARGET_MEM_RATIO}x model": lm["vmhwm_ratio"] <= TARGET_MEM_RATIO,
            f"wall <= {TARGET_TIME_RATIO}x transformers": (
                out["time_ratio"] <= TARGET_TIME_RATIO if "time_ratio" in out else None),
            "correct values/dtype, nothing on meta": lm["correct"],
        }
    return out


def print_table(summary: dict) -> None:
    loaders = summary["loaders"]
    mb = next((s["model_bytes"] for s in loaders.values() if "model_bytes" in s), None)
    size = f"final model {mb / 1e9:.3f} GB" if mb else "no successful run"
    print(f"\n== {summary['description']}  [{summary['case']}]  ({size})")
    print(f"  {'loader':<13}{'runs':>5}{'load s':>9}{'RssAnon/model':>15}{'VmHWM/model':>13}"
          f"{'RssFile after':>15}{'mmap params':>13}{'vs transformers':>17}")
    for loader, s in loaders.items():
        if "load_seconds" not in s:
            print(f"  {loader:<13}{s['runs']:>5}   all {s['crashed']} run(s) crashed")
            continue
        ratio = f"{s['time_vs_transformers']:.2f}x" if loader != "transformers" and "time_vs_transformers" in s else ""
        crashed = f"  ({s['crashed']} crashed)" if s["crashed"] else ""
        wrong = "" if s["correct"] else "  WRONG RESULT (see runs)"
        print(f"  {loader:<13}{s['runs']:>5}{s['load_seconds']:>9.2f}{s['rss_anon_ratio']:>14.3f}x"
              f"{s['vmhwm_ratio']:>12.3f}x{s['rss_file_after_mb']:>12.0f} MB{s['file_backed_param_mb']:>10.0f} MB"
              f"{ratio:>17}{crashed}{wrong}")
    if "targets" in summary:
        parts = []
        for name, ok in summary["targets"].items():
            parts.append(f"{name}: {'n/a' if ok is None else 'PASS' if ok else 'FAIL'}")
        print("  lowmem targets: " + " | ".join(parts))
    elif "lowmem" in loaders:
        print("  lowmem targets: not evaluated (no successful lowmem run)")


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    logdir = workdir / "logs"
    logdir.mkdir(exist_ok=True)

    t_start = time.perf_counter()
    paths = prepare_checkpoints(workdir, args.size_gb, args.cases)
    print(f"[bench] checkpoints ready in {time.perf_counter() - t_start:.1f}s", flush=True)

    drop = args.drop_caches
    if drop and not drop_page_cache():
        print("[bench] WARNING: cannot drop the page cache here (not root / read-only /proc/sys);"
              " continuing with warm-cache loads", flush=True)
        drop = False

    # After generating checkpoints (which would otherwise run real-time too).
    sampler_policy = "normal" if args.no_rt_sampler else boost_sampler_priority()
    print(f"[bench] sampler scheduling policy: {sampler_policy}", flush=True)

    all_runs: list[dict] = []
    summaries = []
    for case in args.cases:
        src_dtype, fmt, target, desc = CASES[case]
        path = paths[(src_dtype, fmt)]
        print(f"\n[bench] {desc}: {path}", flush=True)
        if not drop:
            # Same starting point for every loader (the first run would otherwise pay disk reads).
            prewarm_page_cache(path)
        runs = []
        for rep in range(args.repeats):
            for loader in args.loaders:  # alternate: lowmem, transformers, lowmem, ...
                if drop:
                    drop_page_cache()
                r = run_one(case, loader, path, rep, args, logdir)
                print(f"  [{loader:<12} #{rep}] {fmt_run(r)}", flush=True)
                if not r["ok"] and r.get("stderr_tail"):
                    print("      " + "\n      ".join(r["stderr_tail"]), flush=True)
                runs.append(r)
        all_runs += runs
        summaries.append(summarize(case, runs))

    print("\n" + "=" * 100)
    print(f"Summary (medians of {args.repeats} run(s); memory = peak above the post-import baseline,"
          f" as a multiple of the final model bytes)")
    for s in summaries:
        print_table(s)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    report = {
        "argv": sys.argv,
        "size_gb": args.size_gb,
        "repeats": args.repeats,
        "drop_caches": drop,
        "interval_ms": args.interval_ms,
        "sampler_policy": sampler_policy,
        "targets": {"mem_ratio": TARGET_MEM_RATIO, "time_ratio": TARGET_TIME_RATIO},
        "summaries": summaries,
        "runs": all_runs,
        "total_seconds": time.perf_counter() - t_start,
    }
    for name in (f"results-{stamp}.json", "results-latest.json"):
        (workdir / name).write_text(json.dumps(report, indent=1, default=str))
    crashed = [r for r in all_runs if not r["ok"]]
    print(f"\n[bench] raw results: {workdir / f'results-{stamp}.json'}  "
          f"(total {time.perf_counter() - t_start:.0f}s)")
    if crashed:
        print(f"[bench] {len(crashed)} child run(s) crashed; exit status 1", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
