"""Where a converted load's time goes at large tensors: lowmem_hf at several chunk sizes against transformers.

    python benchmarks/probe_chunks.py DIR [--chunks 4194304 1048576] [--repeats 3]
    OMP_NUM_THREADS=1 python benchmarks/probe_chunks.py DIR    # the same with one intra-op thread

Loads the checkpoint in DIR as bf16 in this one process, transformers then lowmem_hf at each ``chunk_bytes``,
alternating within each repeat, and prints each loader's median time to ``from_pretrained`` return and its ratio
to transformers, lowmem_hf's stages (``LoadReport.stage_seconds``), and where the CPU went (``getrusage``: user and kernel seconds, minor page faults; a fault per
4 KiB page of fresh memory is the kernel's share of a converted load). A probe, not a benchmark: no memory is sampled and the loads share one process (the model's
module is imported before the first clock). ``bench_shapes.py`` is the measurement; this says which knob moves
it. Note that ``chunk_bytes`` is capped by the load so staging stays within 1/128 of the bytes loaded
(``stream.staging_chunk_bytes``): chunks above that cap measure the cap.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from lowmem_hf import LowMemAutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--chunks", type=int, nargs="+", default=[4 << 20, 1 << 20])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(args.path))]  # the modeling module, before the clock
    times: dict[str, list[float]] = {}
    usage: dict[str, list[tuple[float, float, int]]] = {}
    stages: dict[str, list[dict[str, float]]] = {}

    def timed(name: str, load) -> None:
        gc.collect()
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        model = load()
        times.setdefault(name, []).append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        usage.setdefault(name, []).append(
            (after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt))
        report = getattr(model, "lowmem_report", None)
        if report is not None:
            stages.setdefault(name, []).append(dict(report.stage_seconds))
        del model
        gc.collect()

    for _ in range(args.repeats):
        timed("transformers", lambda: AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.bfloat16))
        for chunk in args.chunks:
            timed(f"lowmem_hf chunk {chunk >> 10} KiB", lambda: LowMemAutoModelForCausalLM.from_pretrained(
                args.path, dtype=torch.bfloat16, chunk_bytes=chunk))
    reference = statistics.median(times["transformers"])
    print(f"intra-op threads: {torch.get_num_threads()}; medians of {args.repeats}")
    for name, runs in times.items():
        user, system, faults = (statistics.median(u[i] for u in usage[name]) for i in range(3))
        print(f"{name:<26} {statistics.median(runs):.3f} s  {statistics.median(runs) / reference:.2f}x  "
              f"user {user:.2f} s  kernel {system:.2f} s  minor faults {faults:.0f}  {[round(t, 2) for t in runs]}")
        if name in stages:
            print(f"{'':<26} stages: " + ", ".join(
                f"{stage} {statistics.median(s[stage] for s in stages[name]):.3f} s" for stage in stages[name][0]))


if __name__ == "__main__":
    main()
