"""Beyond RAM: a 7B-class fp32 checkpoint larger than the machine's memory loaded as bf16, each load in a memory
cgroup capped near the model's own size.

    python benchmarks/bench_scale.py                      # ~27 GB fp32 (Llama-2-7B shapes), 1 and 2 TP ranks
    python benchmarks/bench_scale.py --tiny        # the same code on a 0.16 GB checkpoint (hidden 512, 2 layers)
    python benchmarks/bench_scale.py --format bin  # its .bin twin (another 27 GB of disk beside the safetensors)

The checkpoint is the benchmarks' generated Llama with Llama-2-7B's shapes (hidden 4096, intermediate 11008, 32
heads, vocabulary 32000; ``--layers``, default 32: 27 GB in fp32, more than this machine's 24 GiB of RAM), made
once in the workdir. Every load (lowmem_hf, transformers; one process and each rank of 2 TP ranks over gloo) is a
fresh child (``_cgroup_child.py``) placed, before it imports anything, in a cgroup-v1 memory group of its own
(``/sys/fs/cgroup/memory/lowmem-scale-*``, created and removed here; needs root) whose ``memory.limit_in_bytes``
is ``--limit-factor`` x the rank's final model bytes plus ``--base-mb`` (the post-import footprint of torch and
transformers, which a load does not choose; the table prints the limit). Page cache counts toward the limit and is
reclaimed before the kernel kills, so only memory a loader holds on to gets it killed. Per loader and rank: completed
or killed, time, peak RssAnon and VmHWM above the post-import baseline per final byte, major faults, bytes read
from storage (``read_bytes``) and by read calls (``rchar``).

``--limits on off`` (the default) runs every load twice: in a group with that limit, and in one without a limit
(the same accounting, nothing capped). ``--drop-caches`` drops the page cache before each load (root; off by default because the machine is shared; a
checkpoint larger than RAM is mostly cold anyway).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from checkpoints import drop_page_cache, make_bin_twin, make_llama_checkpoint  # noqa: E402
from measure import boost_sampler_priority, free_port, run_children, spawn_child  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
SEVEN_B = dict(hidden=4096, inter=11008, heads=32, kv_heads=32, vocab=32000)
TINY = dict(hidden=512, inter=1376, heads=8, kv_heads=8, vocab=32000, layers=2)


def bf16_bytes(dims: dict, ranks: int) -> int:
    """A rank's final bf16 bytes (TP splits every weight but the norms evenly; the norms are a rounding error)."""
    h, i, v = dims["hidden"], dims["inter"], dims["vocab"]
    params = 2 * v * h + dims["layers"] * (4 * h * h + 3 * h * i + 2 * h) + h
    return params * 2 // ranks


def cgroup_limit(final_bytes: int, factor: float, base_mb: float) -> int:
    """The memory group's limit: ``factor`` x the rank's final bytes plus the process's post-import footprint."""
    return int(final_bytes * factor + base_mb * 2**20)


class MemoryGroup:
    """A cgroup-v1 memory group of its own for one child: created with a limit, the pid added, removed at the end."""

    def __init__(self, name: str, limit: int | None):
        self.path = CGROUP_ROOT / name
        self.path.mkdir()
        if limit is not None:  # None: the group only watches (the same load without a limit)
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        self.limit = limit

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        self.path.rmdir()  # the group is empty once its process has exited


def load(loader: str, path: Path, ranks: int, limit: int | None, logdir: Path, tag: str) -> list[dict]:
    """Every rank of one load, each in its own memory group; per rank its measurements, or how it ended."""
    port, procs, groups = free_port(), [], []
    try:
        for rank in range(ranks):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
            if ranks > 1:
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            groups.append(MemoryGroup(f"lowmem-scale-{os.getpid()}-{tag}-{rank}", limit))
            # the child blocks on its pipe until here: it joins the group before it imports anything
            argv = [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.argv = sys.argv[1:]; "
                    "sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0]); exec(open(sys.argv[0]).read())",
                    str(HERE / "_cgroup_child.py"), "--loader", loader, "--path", str(path)]
            log = open(logdir / f"{tag}-{rank}.log", "w")
            procs.append(spawn_child(argv, env=env, stderr=log))
            groups[-1].add(procs[-1].pid)
            procs[-1].stdin.write(b"joined\n")
        results = run_children(procs, timeout_s=3600)
        for r, g in zip(results, groups):
            r["oom_kills"] = g.oom_kills()
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for g in groups:
            g.remove()


def row(loader: str, ranks: int, rank: int, got: dict, final: int, limit: int | None) -> str:
    shown = f"{limit / 2**30:.2f} GiB" if limit is not None else "none"
    if not got.get("ok"):
        when = "during the load" if "'loading'" in str(got.get("error")) else "before the load"
        how = f"killed (OOM {when})" if got.get("oom_kills") else f"failed: {got.get('error')}"
        return f"| {loader} | {ranks} | {rank} | {shown} | {how} | - | - | - | - | - | - |"
    res = got["result"]
    return (f"| {loader} | {ranks} | {rank} | {shown} | completed | {res['load_seconds']:.1f} s | "
            f"{got['peak_rss_anon_above_baseline_kb'] * 1024 / final:.3f}x | {got['vmhwm_above_baseline_kb'] * 1024 / final:.3f}x | "
            f"{res['majflt']} | {res['read_bytes'] / 1e9:.2f} GB | {res['rchar'] / 1e9:.2f} GB |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="hidden 512, 2 layers: checks the harness in a minute")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--loaders", nargs="+", choices=("lowmem", "transformers"), default=["lowmem", "transformers"])
    ap.add_argument("--limit-factor", type=float, default=1.15)
    ap.add_argument("--base-mb", type=float, default=700.0, help="the post-import footprint added to the limit")
    ap.add_argument("--limits", nargs="+", choices=("on", "off"), default=["on", "off"],
                    help="with the cgroup's limit, and the same loads in a group without one")
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--format", choices=("safetensors", "bin"), default="safetensors",
                    help="bin: the checkpoint's .bin twin (torch.save shards), made once beside it")
    ap.add_argument("--workdir", default="/tmp/scale")
    args = ap.parse_args(argv)
    if not CGROUP_ROOT.is_dir() or not os.access(CGROUP_ROOT, os.W_OK):
        raise SystemExit(f"{CGROUP_ROOT} is not a writable cgroup-v1 memory hierarchy (needs root on cgroup v1)")
    workdir = Path(args.workdir)
    logdir = workdir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    dims = dict(TINY) if args.tiny else dict(SEVEN_B, layers=args.layers)
    name = "tiny" if args.tiny else f"7b-{args.layers}l"
    path = make_llama_checkpoint(workdir, 0.0, torch.float32, dims=dims, name=name)
    if args.format == "bin":
        path = make_bin_twin(path, workdir / (path.name + "-bin"))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors" if args.format == "safetensors" else "*.bin"))
    print(f"[scale] sampler {boost_sampler_priority()}; checkpoint {path} {size / 1e9:.1f} GB fp32", flush=True)
    rows, failed = [], False
    for ranks in args.ranks:
        final = bf16_bytes(dims, ranks)
        for limited in args.limits:
            limit = cgroup_limit(final, args.limit_factor, args.base_mb) if limited == "on" else None
            for loader in args.loaders:
                if args.drop_caches:
                    drop_page_cache()
                results = load(loader, path, ranks, limit, logdir, f"{loader}-{ranks}r-{limited}")
                for rank, got in enumerate(results):
                    rows.append(row(loader, ranks, rank, got, final, limit))
                    print(rows[-1], flush=True)
                    failed |= not got.get("ok") and not got.get("oom_kills")
    print(f"\n{size / 1e9:.1f} GB fp32 {args.format} checkpoint -> bf16; limit = {args.limit_factor} x the rank's final bytes + "
          f"{args.base_mb:.0f} MiB; memory per final byte, above the post-import baseline")
    print("| loader | ranks | rank | cgroup limit | outcome | time | RssAnon | VmHWM | major faults | read_bytes | rchar |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
