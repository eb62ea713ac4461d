"""Per ``AutoModel*`` class: how many model types the switch loads bit-identically, skips (by reason) or fails.

Runs ``tests/test_switch_architectures.py`` (the ``sample`` sweep, or every case with ``--full``) with a JUnit
report and prints one table row per auto class; ``--junit FILE`` only tabulates a report written before, e.g. by
``LOWMEM_SWEEP=full pytest tests/test_switch_architectures.py --junitxml=FILE``. Failures are listed in full.

    python benchmarks/sweep_architectures.py --full
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_switch_architectures.py"
CASE = re.compile(r"test_switch_loads_every_architecture_like_transformers\[(AutoModel\w*)-(.+)\]$")
# the first words of the test's skip reasons, in its order, with the column heading
SKIP_KINDS = {
    "cannot be built from a tiny config": "no tiny build",
    "not tiny after the generic shrink": "not tiny",
    "transformers' own build/save/load fails": "hf save/load fails",
    "transformers' own round trip is not exact": "hf inexact",
}


def run_sweep(*, full: bool, junit: Path) -> None:
    env = dict(os.environ, LOWMEM_SWEEP="full" if full else "sample")
    command = [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    subprocess.run(command, cwd=ROOT, env=env, check=False)  # failures are the point: tabulate them


def outcomes(junit: Path) -> list[tuple[str, str, str, str]]:
    """``(auto class, model type, outcome, detail)`` per case; outcome is passed, a SKIP_KINDS heading, or failed."""
    rows = []
    for case in ET.parse(junit).iter("testcase"):
        match = CASE.match(case.get("name", ""))
        if match is None:
            continue
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failed is not None:
            outcome, detail = "failed", (failed.get("message") or "").strip()
        elif skipped is not None:
            message = (skipped.get("message") or "").removeprefix("Skipped: ")
            outcome = next((kind for prefix, kind in SKIP_KINDS.items() if message.startswith(prefix)), "other skip")
            detail = message
        else:
            outcome, detail = "passed", ""
        rows.append((*match.groups(), outcome, detail))
    return rows


def table(rows: list[tuple[str, str, str, str]]) -> str:
    columns = ["passed", *SKIP_KINDS.values(), "other skip", "failed"]
    counts = collections.defaultdict(collections.Counter)
    for auto_name, _, outcome, _ in rows:
        counts[auto_name][outcome] += 1
        counts["TOTAL"][outcome] += 1
    width = max(len(name) for name in counts)
    lines = [f"{'auto class':<{width}} " + " ".join(f"{c:>{len(c) if len(c) > 6 else 6}}" for c in ["cases", *columns])]
    for auto_name in sorted(counts, key=lambda name: (name == "TOTAL", name)):
        count = counts[auto_name]
        cells = [sum(count.values()), *(count[c] for c in columns)]
        lines.append(f"{auto_name:<{width}} " + " ".join(f"{v:>{len(c) if len(c) > 6 else 6}}" for c, v in zip(["cases", *columns], cells)))
    return "\n".join(lines)


def reasons(rows: list[tuple[str, str, str, str]]) -> str:
    """The skip reasons under each heading, most frequent first, with their case counts; then every failure."""
    lines = []
    for prefix, kind in [*SKIP_KINDS.items(), ("", "other skip")]:
        details = [d.removeprefix(prefix).lstrip(": ") for _, _, outcome, d in rows if outcome == kind]
        if not details:
            continue
        lines += ["", f"{kind} ({len(details)} cases): {prefix}"]
        if kind == "not tiny":  # one parameter count per type: the range says enough
            sizes = sorted(int(re.sub(r"\D", "", d)) for d in details)
            lines.append(f"  {sizes[0]:,} to {sizes[-1]:,} parameters")
            continue
        lines += [f"  {n:4d}  {reason[:200]}" for reason, n in collections.Counter(details).most_common()]
    failures = [(a, t, d) for a, t, outcome, d in rows if outcome == "failed"]
    lines += ["", f"failed ({len(failures)} cases):"] + [f"  {a}-{t}: {d[:600]}" for a, t, d in failures]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every (auto class, model type), not the CI sample")
    parser.add_argument("--junit", type=Path, help="tabulate this JUnit report instead of running the sweep")
    args = parser.parse_args(argv)
    if args.junit is None:
        args.junit = Path(tempfile.mkdtemp(prefix="lowmem-sweep-")) / "sweep.xml"
        run_sweep(full=args.full, junit=args.junit)
    rows = outcomes(args.junit)
    print(table(rows))
    print(reasons(rows))


if __name__ == "__main__":
    main()
