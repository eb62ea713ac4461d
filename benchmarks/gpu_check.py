"""One command for the GPU machine: is lowmem_hf's load onto a device bit-identical to transformers', how fast is it
against transformers, ``safetensors.torch.load_file`` and the machine's own host-to-device copy, and what memory does
it take? Prints one table; exit status 1 on any inequality or failed load.

    python benchmarks/gpu_check.py [--device cuda] [--size-gb 4.0] [--repeats 2] [--cache warm cold]
        [--workdir /tmp/gpu_check] [--wheels benchmarks/_gpu_wheels] [--no-overlap] [--no-convert-on-device]
        [--tp-ranks N]
    python benchmarks/gpu_check.py --device cpu --small      # CI (tests/test_gpu_check.py): the same code, < 2 min

The checkpoint is the benchmarks' generated Llama (``checkpoints.py``), ``--size-gb`` in fp32 (``--small``: 0.05),
stored once as fp32 and once as bf16, both loaded as bf16:

- **equality**: every tensor of ``lowmem`` (``device=``), ``lowmem-map`` (``device_map={"": 0}``) and
  ``lowmem-ambient`` (``with torch.device(...)``) hashed against transformers' load of the same request
  (``device_map={"": 0}``), and ``safetensors`` (each tensor cast on the device) against it too;
- **time to a usable model**: from the call to the weights on the device with the device idle, each load a fresh
  child (``_gpu_child.py``), the loaders alternating within each repeat, medians; ``cold`` drops the page cache
  before each load (root only; skipped with a note elsewhere). ``x copy`` is the load's bytes-on-device per
  second over a plain pinned host-to-device ``copy_`` of the same run (on the CPU: a plain memory copy);
- **memory**: peak host RssAnon and VmHWM above the post-import baseline (sampled by this process) and
  ``torch.cuda.max_memory_allocated``, each per byte of the loaded model;
- **tensor parallelism** (``--tp-ranks``; on CUDA by default 2 where the machine has 2 GPUs, none with one; on the
  CPU 2): both cases again as ``tp_plan="auto"`` loads of N ranks over NCCL (gloo on the CPU), one process per
  rank, each on the device transformers binds it to. Each rank's local shards are hashed against transformers' same
  rank; the time is the slowest rank's, bytes/s and memory are per rank (the largest).

``--no-overlap`` / ``--no-convert-on-device`` run lowmem_hf's loads with ``LOWMEM_HF_GPU_OVERLAP=0`` /
``LOWMEM_HF_GPU_CONVERT_ON_DEVICE=0`` (docs/usage.md): the same table without the copies overlapping the reads, or
with chunks converted by ``copy_`` itself, to time each change against its absence.

``--wheels DIR`` (the GPU machine has no registry and an older transformers): unpacks DIR's wheels
(``gpu_wheels.sh`` builds them) into a folder under the workdir and runs again, this process and its children, with
that folder first on the path (no pip needed: a wheel is a zip of its files).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# checkpoints and measure (which imports lowmem_hf) are imported in main, after --wheels has put the carried
# transformers first on the path: the machine's own may be older than lowmem_hf's floor. main puts this folder on
# the path itself (run as a script it is there already): imported by the tests, this module must not put
# benchmarks/checkpoints.py before tests/checkpoints.py

LOADERS = ("lowmem", "transformers", "safetensors")  # timed, alternating
VARIANTS = ("lowmem-map", "lowmem-ambient")  # checked for equality once (fp32 case)
CASES = {"fp32 -> bf16": "float32", "bf16 -> bf16": "bfloat16"}  # case -> stored dtype; all load as bf16
REFERENCE = "transformers"


def install_wheels(wheels: Path, workdir: Path) -> Path:
    """Unpack ``wheels/*.whl`` into ``workdir/site`` (once per set of wheels); the folder to put first on the path."""
    target = workdir / "site"
    marker = target / ".installed"
    names = sorted(p.name for p in wheels.glob("*.whl"))
    if not names:
        raise SystemExit(f"--wheels {wheels}: no .whl files there (benchmarks/gpu_wheels.sh builds them)")
    if marker.exists() and marker.read_text() == "\n".join(names):
        return target
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        with zipfile.ZipFile(wheels / name) as wheel:
            wheel.extractall(target)
    marker.write_text("\n".join(names))
    return target


def rerun_with(site: Path) -> None:
    """Run this command again with ``site`` first on the path (once: the second run finds it there)."""
    if str(site) in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def switches(args) -> dict[str, str]:
    """The environment that turns off what ``--no-overlap`` / ``--no-convert-on-device`` name, for every child."""
    return {
        **({"LOWMEM_HF_GPU_OVERLAP": "0"} if args.no_overlap else {}),
        **({"LOWMEM_HF_GPU_CONVERT_ON_DEVICE": "0"} if args.no_convert_on_device else {}),
    }


def child_env(site: Path | None) -> dict[str, str]:
    """The working tree's lowmem_hf first (over an installed one), then the carried wheels, then the machine's."""
    env = dict(os.environ, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    paths = [str(REPO), *([str(site)] if site else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def run_one(argv: list[str], env: dict[str, str], timeout_s: float) -> dict:
    """One protocol child, measured; a failed child raises with its stderr tail (the log is ``$GPU_CHECK_LOG``)."""
    from measure import run_child

    log = Path(env["GPU_CHECK_LOG"])
    with open(log, "w") as stderr:
        got = run_child([sys.executable, str(HERE / "_gpu_child.py"), *argv], env=env, stderr=stderr, timeout_s=timeout_s)
    if not got["ok"]:
        raise RuntimeError(f"{' '.join(argv)}: {got['error']}; stderr tail:\n{log.read_text()[-3000:]}")
    result = dict(got["result"])
    result["rss_anon"] = got["peak_rss_anon_above_baseline_kb"] * 1024
    result["vmhwm"] = got["vmhwm_above_baseline_kb"] * 1024
    return result


def load_once(loader: str, path: Path, device: str, cache: str, env: dict, timeout_s: float, *, digest: bool = True) -> dict:
    """One load in a fresh child; ``digest``: also hash every tensor (after the clock; ~1 s per GB on the host)."""
    from checkpoints import drop_page_cache, prewarm_page_cache

    drop_page_cache() if cache == "cold" else prewarm_page_cache(path)
    argv = ["--loader", loader, "--path", str(path), "--dtype", "bfloat16", "--device", device]
    got = run_one(argv + ([] if digest else ["--no-digest"]), env, timeout_s)
    print(f"  [{path.name} {cache} {loader:<14}] {got['load_seconds']:.2f} s, {got['model_bytes'] / 1e9:.2f} GB", flush=True)
    return got


def compare(got: dict, reference: dict) -> str:
    """``equal``, or what differs: tensors missing from either side, tensors whose bytes differ, or devices."""
    mine, theirs = got["digest"], reference["digest"]
    if got.get("devices") != reference.get("devices"):
        return f"on {got.get('devices')}, transformers' on {reference.get('devices')}"
    missing = sorted(set(theirs) - set(mine))
    extra = sorted(set(mine) - set(theirs))
    differ = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} not in transformers' (e.g. {extra[0]})")
    if differ:
        problems.append(f"{len(differ)} differ (e.g. {differ[0]})")
    return "; ".join(problems) or "equal"


def measure_case(path: Path, args, env: dict, variants: tuple[str, ...]) -> tuple[dict, dict[str, str]]:
    """Timed runs per (loader, cache), and each loader's equality against transformers' (each loader's first run is
    hashed; the other repeats only timed, to keep the check within minutes)."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for cache in args.cache:
        for rep in range(args.repeats):
            for loader in LOADERS:
                hashed = cache == args.cache[0] and rep == 0
                got = load_once(loader, path, args.device, cache, env, args.timeout, digest=hashed)
                runs.setdefault((loader, cache), []).append(got)
    reference = runs[(REFERENCE, args.cache[0])][0]
    equality = {}
    for (loader, _), got in runs.items():
        if loader != REFERENCE:
            for run in (r for r in got if r["digest"] is not None):
                verdict = compare(run, reference) if loader != "safetensors" else compare_weights(run, reference)
                equality[loader] = verdict if equality.get(loader, "equal") == "equal" else equality[loader]
    for variant in variants:
        equality[variant] = compare(load_once(variant, path, args.device, args.cache[0], env, args.timeout), reference)
    return runs, equality


def load_ranks(loader: str, path: Path, args, cache: str, env: dict, *, digest: bool) -> list[dict]:
    """One ``tp_plan="auto"`` load of ``args.tp_ranks`` ranks, a fresh process each, started together and sampled
    by this process; a failed rank raises with its stderr tail."""
    from checkpoints import drop_page_cache, prewarm_page_cache
    from measure import free_port, run_ranks

    drop_page_cache() if cache == "cold" else prewarm_page_cache(path)
    port = free_port()
    argv = [sys.executable, str(HERE / "_gpu_child.py"), "--tp", "--loader", loader, "--path", str(path), "--dtype", "bfloat16",
            "--device", args.device, *([] if digest else ["--no-digest"])]
    ranks = range(args.tp_ranks)
    commands = [(argv, dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.tp_ranks), LOCAL_WORLD_SIZE=str(args.tp_ranks),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in ranks]
    got = run_ranks(commands, [Path(env["GPU_CHECK_LOG"]).with_suffix(f".rank{r}.log") for r in ranks], timeout_s=args.timeout)
    results = [dict(one["result"], rss_anon=one["peak_rss_anon_above_baseline_kb"] * 1024, vmhwm=one["vmhwm_above_baseline_kb"] * 1024)
               for one in got]
    seconds = max(r["load_seconds"] for r in results)
    print(f"  [{path.name} {cache} tp{args.tp_ranks} {loader:<12}] {seconds:.2f} s, "
          f"{max(r['model_bytes'] for r in results) / 1e9:.2f} GB per rank", flush=True)
    return results


def measure_tp(path: Path, args, env: dict) -> tuple[dict, dict[str, str]]:
    """``measure_case`` at ``args.tp_ranks`` ranks: lowmem_hf and transformers alternating, each rank's first load
    hashed against transformers' same rank. A run is summarized as one load: the slowest rank's time, the largest
    rank's bytes and memory."""
    runs: dict[tuple[str, str], list[dict]] = {}
    ranked: dict[str, list[dict]] = {}
    for cache in args.cache:
        for rep in range(args.repeats):
            for loader in ("lowmem", REFERENCE):
                hashed = cache == args.cache[0] and rep == 0
                ranks = load_ranks(loader, path, args, cache, env, digest=hashed)
                if hashed:
                    ranked[loader] = ranks
                largest = max(ranks, key=lambda r: r["model_bytes"])
                runs.setdefault((loader, cache), []).append(dict(
                    largest, load_seconds=max(r["load_seconds"] for r in ranks),
                    rss_anon=max(r["rss_anon"] for r in ranks), vmhwm=max(r["vmhwm"] for r in ranks),
                ))
    verdicts = [f"rank {rank}: {compare(mine, theirs)}" for rank, (mine, theirs) in enumerate(zip(ranked["lowmem"], ranked[REFERENCE]))]
    unequal = [v for v in verdicts if not v.endswith(": equal")]
    return runs, {"lowmem": "; ".join(unequal) or "equal"}


def compare_weights(got: dict, reference: dict) -> str:
    """``safetensors`` holds the checkpoint's tensors only: compared on those (the model adds buffers)."""
    theirs = {k: v for k, v in reference["digest"].items() if k in got["digest"]}
    return compare(got, dict(reference, digest=theirs))


def rows(case: str, runs: dict, equality: dict[str, str], copy_bps: float) -> list[str]:
    out = []
    for (loader, cache), got in runs.items():
        t = statistics.median(r["load_seconds"] for r in got)
        nbytes = got[0]["model_bytes"]
        dev = got[0]["device_max_allocated"]
        out.append(
            f"| {case} | {loader} | {cache} | {t:.3f} s | {nbytes / t / 1e9:.2f} GB/s | {nbytes / t / copy_bps:.2f}x | "
            f"{max(r['rss_anon'] for r in got) / nbytes:.3f}x | {max(r['vmhwm'] for r in got) / nbytes:.3f}x | "
            f"{'-' if dev is None else f'{dev / nbytes:.3f}x'} | {equality.get(loader, 'reference')} |"
        )
    for variant in VARIANTS:
        if variant in equality:
            out.append(f"| {case} | {variant} | - | - | - | - | - | - | - | {equality[variant]} |")
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (cuda:0) or cpu")
    ap.add_argument("--size-gb", type=float, default=4.0, help="checkpoint size in fp32, 1 GB = 1e9 bytes")
    ap.add_argument("--small", action="store_true", help="a 0.05 GB checkpoint, one repeat, warm only (CI)")
    ap.add_argument("--repeats", type=int, default=2, help="timed loads per loader and cache (2 x 3 x 2 x 2 children "
                    "of ~10 s each on the GPU machine fit its 8 minutes; 3 may not)")
    ap.add_argument("--cache", nargs="+", choices=("warm", "cold"), default=["warm", "cold"])
    ap.add_argument("--workdir", default="/tmp/gpu_check")
    ap.add_argument("--wheels", help="a folder of wheels (gpu_wheels.sh) to install and put first on the children's path")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    ap.add_argument("--no-overlap", action="store_true", help="LOWMEM_HF_GPU_OVERLAP=0 for every child: one "
                    "staging buffer per reader thread, whose next read waits for its copy")
    ap.add_argument("--no-convert-on-device", action="store_true", help="LOWMEM_HF_GPU_CONVERT_ON_DEVICE=0 for every "
                    "child: converted chunks go through copy_ as they are")
    ap.add_argument("--tp-ranks", type=int, help="ranks of the tensor-parallel rows, 0 for none (default: 2 on the "
                    "CPU; on CUDA 2 where there are 2 GPUs, else none)")
    args = ap.parse_args(argv)
    if args.small:
        args.size_gb, args.repeats, args.cache = 0.05, 1, ["warm"]
    if args.device.startswith("cuda") and ":" not in args.device:
        args.device = "cuda:0"
    from checkpoints import drop_page_cache

    if "cold" in args.cache and not drop_page_cache():
        print("[gpu_check] cannot drop the page cache here (needs root): cold rows skipped", flush=True)
        args.cache = [c for c in args.cache if c != "cold"] or ["warm"]
    return args


def main(argv=None) -> int:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    args = parse(argv)
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    site = install_wheels(Path(args.wheels).resolve(), workdir) if args.wheels else None
    if site is not None:
        rerun_with(site)
    from checkpoints import make_llama_checkpoint
    from measure import boost_sampler_priority

    env = dict(child_env(site), GPU_CHECK_LOG=str(workdir / "child.log"), **switches(args))
    print(f"[gpu_check] sampler {boost_sampler_priority()}, device {args.device}, {args.size_gb:g} GB fp32, "
          f"switches {switches(args) or 'default'}", flush=True)
    import torch

    if args.tp_ranks is None:
        args.tp_ranks = 2 if not args.device.startswith("cuda") or torch.cuda.device_count() >= 2 else 0
    if args.device.startswith("cuda") and args.tp_ranks > torch.cuda.device_count():
        raise SystemExit(f"--tp-ranks {args.tp_ranks}: this machine has {torch.cuda.device_count()} GPU(s), one per rank")
    if not args.tp_ranks:
        why = "one GPU (--tp-ranks 2 needs 2)" if args.device.startswith("cuda") else "--tp-ranks 0"
        print(f"[gpu_check] {why}: no tensor-parallel rows", flush=True)
    paths = {case: make_llama_checkpoint(workdir, args.size_gb, getattr(torch, stored)) for case, stored in CASES.items()}
    nbytes = min(1 << 30, sum(f.stat().st_size for f in paths["bf16 -> bf16"].glob("*.safetensors")))
    copy = run_one(["--loader", "copy", "--device", args.device, "--nbytes", str(nbytes)], env, args.timeout)
    table, failed = [], []
    for case, path in paths.items():
        runs, equality = measure_case(path, args, env, VARIANTS if case == "fp32 -> bf16" else ())
        table += rows(case, runs, equality, copy["bytes_per_second"])
        failed += [f"{case} {loader}: {verdict}" for loader, verdict in equality.items() if verdict != "equal"]
    for case, path in paths.items() if args.tp_ranks else ():
        runs, equality = measure_tp(path, args, env)
        table += rows(f"tp{args.tp_ranks} {case}", runs, equality, copy["bytes_per_second"])
        failed += [f"tp{args.tp_ranks} {case} {loader}: {verdict}" for loader, verdict in equality.items() if verdict != "equal"]
    kind = "pinned host-to-device" if copy["pinned"] else "host memory"
    print(f"\n{kind} copy_ of {copy['nbytes'] / 1e9:.2f} GB: {copy['bytes_per_second'] / 1e9:.2f} GB/s (best of 5); "
          f"medians of {args.repeats}; memory = peak above the post-import baseline per loaded byte (max over repeats)")
    print("| case | loader | cache | to usable | bytes/s | x copy | host RssAnon | host VmHWM | device max allocated | "
          "vs transformers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(table))
    for line in failed:
        print(f"INEQUALITY {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
