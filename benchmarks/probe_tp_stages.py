"""Where a warm load's time goes at two TP ranks: each rank's return time, its CPU and lowmem_hf's stages.

    python benchmarks/probe_tp_stages.py DIR [--ranks 2] [--rounds 2]

Runs ``--ranks`` gloo ranks on this machine, ``tp_plan="auto"``, loading DIR as bf16, lowmem_hf then transformers
in each round (each load a fresh set of processes; the model's module imported and a tiny model's forward run
before the clock, as ``_usable_child.py`` does). Prints, per rank: the time to return, the CPU it used
(``os.times()``: user and kernel seconds) and lowmem_hf's ``LoadReport.stage_seconds``. A probe, not a
benchmark: no memory is sampled and the page cache is left as it is (warm it first); ``bench_shapes.py`` is the
measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank_main(path: str, loader: str) -> None:
    """One rank: load ``path`` with ``loader`` and print its line."""
    import time

    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    import lowmem_hf
    from _usable_child import first_forward

    torch.set_num_threads(1)  # the ranks share the cores
    dist.init_process_group("gloo")
    config = AutoConfig.from_pretrained(path)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    ours = lowmem_hf.LowMemAutoModelForCausalLM
    first_forward(config, torch.bfloat16)
    dist.barrier()
    before, start = os.times(), time.perf_counter()
    if loader == "lowmem":
        model = ours.from_pretrained(path, torch_dtype=torch.bfloat16, tp_plan="auto")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, tp_plan="auto")
    seconds, after = time.perf_counter() - start, os.times()
    report = getattr(model, "lowmem_report", None)
    stages = " ".join(f"{k} {v:.3f}" for k, v in report.stage_seconds.items()) if report is not None else ""
    print(f"rank {dist.get_rank()} {loader:<12} {seconds:.3f} s  CPU user {after.user - before.user:.2f} s "
          f"kernel {after.system - before.system:.2f} s  {stages}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path", nargs="?")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rank-of", nargs=2, metavar=("PATH", "LOADER"), help=argparse.SUPPRESS)  # a rank's own run
    args = ap.parse_args()
    if args.rank_of:
        rank_main(*args.rank_of)
        return
    if args.path is None:
        ap.error("the checkpoint folder (path) is required")
    from measure import free_port
    for _ in range(args.rounds):
        for loader in ("lowmem", "transformers"):
            port = free_port()
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(args.ranks),
                       LOCAL_WORLD_SIZE=str(args.ranks), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TQDM_DISABLE="1",
                       HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_VERBOSITY="error",
                       PYTHONPATH=os.pathsep.join(p for p in (str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")) if p))
            procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", args.path, loader],
                                      env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(args.ranks)]
            if any(p.wait() != 0 for p in procs):
                raise SystemExit(f"a {loader} rank failed")


if __name__ == "__main__":
    main()
