"""Plan and load one rank of a very large job, alone: Llama-3.2-1B, 3-8B, 3-70B and 3.1-405B shapes, sparse files.

    python benchmarks/bench_scale_plan.py [--models llama3.2-1b llama3-8b llama3-70b llama3.1-405b]
        [--meshes tp8 tp8xfsdp8] [--load-models llama3.2-1b llama3-8b] [--load-mesh tp8xfsdp8] [--workdir /tmp/scale]
        [--png benchmarks/scale_curve.png]

Each checkpoint is a real model's headers over holes (``checkpoints.make_sparse_llama``: bf16, 5 GB shards, a few
hundred KB of disk), so nothing here needs the real weights. Every measurement is a fresh child
(``_scale_child.py``) whose memory this process samples (peak RssAnon and VmHWM above the post-import baseline):

- **plan**: ``prepare(...).estimate()`` of every rank of the mesh in one process with no process group
  (``MeshRank``), as ``lowmem-hf plan --tp-size 8 --fsdp-size 8`` runs it: the whole mesh's time, per rank, and
  the process's memory;
- **load**: rank 0's share loaded as bf16 with ``device_mesh=MeshRank(...)`` (reads of holes: the kernel's zero
  fill instead of a disk, so the time is the loader's own cost per byte), bytes read against the plan, memory per
  final byte; **bare** is the same rank's planned reads into fresh destinations with ``preadv`` and nothing else.

Prints two tables and draws plan and load time against model size into ``--png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from checkpoints import REAL_SHAPES, make_sparse_llama  # noqa: E402
from measure import boost_sampler_priority, run_child  # noqa: E402

MESHES = {"tp8": dict(tp_size=8, fsdp_size=1), "tp8xfsdp8": dict(tp_size=8, fsdp_size=8)}
GB = 1e9


def child(mode: str, path: Path, mesh: str, log: Path, rank: int = 0) -> dict:
    sizes = MESHES[mesh]
    argv = [sys.executable, str(HERE / "_scale_child.py"), "--mode", mode, "--path", str(path), "--rank", str(rank),
            "--tp-size", str(sizes["tp_size"]), "--fsdp-size", str(sizes["fsdp_size"])]
    with open(log, "w") as stderr:
        got = run_child(argv, stderr=stderr, timeout_s=3600)
    if not got["ok"]:
        raise RuntimeError(f"{mode} {path.name} {mesh}: {got['error']}\n{log.read_text()[-2000:]}")
    return dict(got["result"], rss_anon=got["peak_rss_anon_above_baseline_kb"] * 1024, vmhwm=got["vmhwm_above_baseline_kb"] * 1024)


def params_of(path: Path) -> float:
    """Parameters in billions, from the generator's marker (bf16: 2 bytes each)."""
    return json.loads((path / "bench_checkpoint.json").read_text())["total_size"] / 2 / 1e9


def draw(points: dict[str, list[tuple[float, float]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xy in points.items():
        if xy:
            xs, ys = zip(*sorted(xy))
            ax.plot(xs, ys, marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="model parameters (billions)", ylabel="seconds",
           title="lowmem_hf: one process plans a mesh; one rank loads its share (sparse checkpoints, 2 CPU cores)")
    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(REAL_SHAPES), default=list(REAL_SHAPES))
    ap.add_argument("--meshes", nargs="+", choices=list(MESHES), default=list(MESHES))
    ap.add_argument("--load-models", nargs="*", choices=list(REAL_SHAPES), default=["llama3.2-1b", "llama3-8b"])
    ap.add_argument("--load-mesh", choices=list(MESHES), default="tp8xfsdp8")
    ap.add_argument("--workdir", default="/tmp/scale")
    ap.add_argument("--png", default=str(HERE / "scale_curve.png"))
    args = ap.parse_args(argv)
    workdir = Path(args.workdir)
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    print(f"[scale] sampler {boost_sampler_priority()}", flush=True)
    paths = {m: make_sparse_llama(workdir, m) for m in dict.fromkeys(args.models + args.load_models)}
    points: dict[str, list] = {f"plan, per rank ({m})": [] for m in args.meshes}
    points.update({f"plan, whole {m} mesh": [] for m in args.meshes})
    plan_rows, load_rows = [], []
    for model in args.models:
        for mesh in args.meshes:
            got = child("plan", paths[model], mesh, workdir / "logs" / f"plan-{model}-{mesh}.log")
            per = statistics.median(got["per_rank_seconds"])
            b = params_of(paths[model])
            points[f"plan, per rank ({mesh})"].append((b, per))
            points[f"plan, whole {mesh} mesh"].append((b, got["seconds"]))
            plan_rows.append(f"| {model} | {b:.1f} B | {mesh} | {got['ranks']} | {got['seconds']:.1f} s | {per:.3f} s | "
                             f"{got['rss_anon'] / 2**20:.0f} MiB | {got['vmhwm'] / 2**20:.0f} MiB | "
                             f"{got['final_bytes'][0] / GB:.2f} GB | {max(got['final_bytes']) / GB:.2f} GB |")
            print(plan_rows[-1], flush=True)
    for model in args.load_models:
        plan = child("plan", paths[model], args.load_mesh, workdir / "logs" / f"plan-{model}-{args.load_mesh}.log")
        runs = {mode: child(mode, paths[model], args.load_mesh, workdir / "logs" / f"{mode}-{model}.log") for mode in ("load", "bare")}
        load, bare = runs["load"], runs["bare"]
        b = params_of(paths[model])
        points.setdefault(f"load rank 0 ({args.load_mesh})", []).append((b, load["seconds"]))
        points.setdefault(f"bare rank 0 ({args.load_mesh})", []).append((b, bare["seconds"]))
        final = load["model_bytes"]
        load_rows.append(f"| {model} | {args.load_mesh} | {final / GB:.2f} GB | {load['seconds']:.2f} s | {bare['seconds']:.2f} s | "
                         f"{load['seconds'] / bare['seconds']:.2f}x | {load['bytes_read'] / plan['bytes_to_read'][0]:.4f} | "
                         f"{load['rss_anon'] / final:.3f}x | {load['vmhwm'] / final:.3f}x |")
        print(load_rows[-1], flush=True)
    print("\nplan: every rank of the mesh in one process, no process group; memory = the process's peak above its "
          "post-import baseline")
    print("| model | params | mesh | ranks | whole mesh | per rank (median) | RssAnon | VmHWM | rank 0 final | largest rank final |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(plan_rows))
    print("\nload: rank 0's share as bf16, alone; bare = the same planned reads with preadv into fresh memory, nothing else")
    print("| model | mesh | rank 0 final | load | bare | load / bare | bytes read / plan | RssAnon / final | VmHWM / final |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(load_rows))
    draw(points, Path(args.png))
    print(f"\n[scale] wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
