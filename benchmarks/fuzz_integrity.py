"""The integrity outcomes table: generated bad inputs and faults against a tiny Llama, each load in its own process.

    python benchmarks/fuzz_integrity.py [--examples 400] [--seed 0] [--seconds 60] [--categories a,b] [--show 3]

The generators and the per-trial child are tests/integrity_fuzz.py's, the ones the property suite
(tests/test_integrity_properties.py) draws from with hypothesis; here a ``random.Random`` seeded by
``(seed, category, i)`` draws them, so a run is the same list of trials every time. ``--examples`` trials are split
evenly over the categories. Prints trials per category and outcome (intact / named error / raw exception / wrong
model / crash / hang / data lost, see that module's docstring), then up to ``--show`` trials of every outcome other
than intact and named, each with the command-line-free description needed to replay it
(``integrity_fuzz.Trial``).
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import integrity_fuzz as fuzz  # noqa: E402  (imports nothing of the stack at module level)


def main(argv=None) -> int:
    # huggingface_hub reads these once, at import (in the fork server, started below): a private HF_HOME, offline
    # except where a trial points it at its own loopback Hub. Not at module level: every trial's child runs this
    # module again as __mp_main__
    hf_home = tempfile.mkdtemp(prefix="fuzz-hf-home-")
    os.environ.update(HF_HOME=hf_home, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=400, help="trials in all, split evenly over the categories")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=fuzz.LOAD_SECONDS, help="time limit of one trial")
    parser.add_argument("--categories", default=",".join(fuzz.GENERATORS), help="comma-separated subset")
    parser.add_argument("--show", type=int, default=3, help="trials listed per category for each bad outcome")
    args = parser.parse_args(argv)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    unknown = sorted(set(categories) - set(fuzz.GENERATORS))
    if unknown:
        parser.error(f"unknown categories {unknown}; known: {list(fuzz.GENERATORS)}")

    root = tempfile.mkdtemp(prefix="fuzz-integrity-")
    try:
        workspace = fuzz.build_workspace(os.path.join(root, "checkpoints"))
        runner = fuzz.Runner(workspace, root, seconds=args.seconds)
        per_category = max(1, args.examples // len(categories))
        table: dict[str, collections.Counter] = {}
        bad: dict[tuple[str, str], list[tuple[fuzz.Trial, fuzz.Outcome]]] = collections.defaultdict(list)
        started = time.perf_counter()
        for category in categories:
            table[category] = collections.Counter()
            for trial in fuzz.seeded_trials(category, per_category, args.seed):
                outcome = runner.run(trial)
                table[category][outcome.kind] += 1
                if outcome.kind not in fuzz.OK:
                    bad[(category, outcome.kind)].append((trial, outcome))
            print(f"  {category}: {dict(table[category])} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
        elapsed = time.perf_counter() - started
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(hf_home, ignore_errors=True)

    print(f"python benchmarks/fuzz_integrity.py --examples {args.examples} --seed {args.seed}"
          + (f" --categories '{args.categories}'" if args.categories != ",".join(fuzz.GENERATORS) else ""))
    print(f"{sum(sum(c.values()) for c in table.values())} trials in {elapsed:.0f} s, one process each, {args.seconds:.0f} s limit\n")
    print(_table(table))
    for (category, kind), cases in sorted(bad.items()):
        print(f"\n{kind} in {category} ({len(cases)}):")
        for trial, outcome in cases[: args.show]:
            print(f"  - {trial.label}\n      {outcome.detail.splitlines()[0] if outcome.detail else ''}")
    return 0 if not bad else 1


def _table(table: dict[str, collections.Counter]) -> str:
    names = {"intact": "intact", "named": "named error", "raw": "raw exception", "wrong": "wrong model",
             "crash": "crash", "hang": "hang", "lost": "data lost"}
    header = ["category", "trials", *names.values()]
    rows = [[c, str(sum(t.values())), *(str(t[k]) for k in names)] for c, t in table.items()]
    total = collections.Counter()
    for t in table.values():
        total.update(t)
    rows.append(["all", str(sum(total.values())), *(str(total[k]) for k in names)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(r, widths))) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


if __name__ == "__main__":
    sys.exit(main())
