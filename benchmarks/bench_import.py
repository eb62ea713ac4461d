"""Import cost: what ``import lowmem_hf`` adds to a process, next to ``import torch`` and ``import transformers``.

    python benchmarks/bench_import.py [--repeats 5] [--against REV]

Each case runs in a fresh interpreter (one per case and repeat, the cases alternating within each repeat) and
reports, right after its statement: the statement's wall time, VmHWM (peak resident memory, file pages
included) and RssAnon (anonymous memory) from ``/proc/self/status``, and how many modules are loaded. Printed
are the medians over the repeats, then lowmem_hf against transformers and torch. ``--against REV`` also
measures lowmem_hf as of git revision REV, checked out into a temporary ``git worktree`` (removed at the end)
and put first on ``PYTHONPATH``; this tree is never touched, so others may edit it meanwhile.

The ``... .LowMemAutoModelForCausalLM`` cases are the first use: the import plus the attribute, which is where
the deferred modules (torch, transformers' modeling code) are loaded now.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Modules lowmem_hf leaves for first use; the child reports which of them its statement loaded.
HEAVY = ("torch", "transformers.modeling_utils", "transformers.models.auto.modeling_auto")

_CHILD = r"""
import json, re, sys, time
start = time.perf_counter()
exec(sys.argv[1])
seconds = time.perf_counter() - start
status = open("/proc/self/status").read()
kib = lambda field: int(re.search(field + r":\s+(\d+) kB", status).group(1))
lowmem = sys.modules.get("lowmem_hf")
print(json.dumps({
    "seconds": seconds, "vm_hwm_kib": kib("VmHWM"), "rss_anon_kib": kib("RssAnon"), "modules": len(sys.modules),
    "heavy": [m for m in json.loads(sys.argv[2]) if m in sys.modules],
    "lowmem_hf_file": getattr(lowmem, "__file__", None),
}))
"""


def cases(against: str | None) -> list[tuple[str, str, str]]:
    """``(label, statement, tree)``: the tree goes first on ``PYTHONPATH`` ("" for the installed packages)."""
    now = str(REPO)
    found = [
        ("python (no import)", "pass", ""),
        ("import torch", "import torch", ""),
        ("import transformers", "import transformers", ""),
        ("import lowmem_hf", "import lowmem_hf", now),
        ("import lowmem_hf; .LowMemAutoModelForCausalLM", "import lowmem_hf; lowmem_hf.LowMemAutoModelForCausalLM", now),
    ]
    if against:
        found += [
            (f"import lowmem_hf @{against}", "import lowmem_hf", "AGAINST"),
            (f"import lowmem_hf; .LowMemAutoModelForCausalLM @{against}", "import lowmem_hf; lowmem_hf.LowMemAutoModelForCausalLM", "AGAINST"),
        ]
    return found


def measure(statement: str, tree: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as cwd:  # not the repo: `-c` puts the cwd first on sys.path
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, statement, json.dumps(HEAVY)], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
        )
    if proc.returncode != 0:
        raise SystemExit(f"{statement!r} with PYTHONPATH={tree!r} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if tree and not (result["lowmem_hf_file"] or "").startswith(tree + os.sep):
        raise SystemExit(f"{statement!r} imported lowmem_hf from {result['lowmem_hf_file']}, not from {tree}")
    return result


def summarize(runs: list[dict]) -> dict:
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "vm_hwm_mib": statistics.median(r["vm_hwm_kib"] for r in runs) / 1024,
        "rss_anon_mib": statistics.median(r["rss_anon_kib"] for r in runs) / 1024,
        "modules": int(statistics.median(r["modules"] for r in runs)),
        "heavy": runs[-1]["heavy"],
    }


def compare(name: str, ours: dict, theirs: dict) -> str:
    return (
        f"{name:<56} time {ours['seconds'] - theirs['seconds']:+.2f} s ({ours['seconds'] / theirs['seconds']:.2f}x), "
        f"VmHWM {ours['vm_hwm_mib'] - theirs['vm_hwm_mib']:+.0f} MiB ({ours['vm_hwm_mib'] / theirs['vm_hwm_mib']:.2f}x), "
        f"RssAnon {ours['rss_anon_mib'] - theirs['rss_anon_mib']:+.0f} MiB ({ours['rss_anon_mib'] / theirs['rss_anon_mib']:.2f}x)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--against", metavar="REV", help="also measure lowmem_hf as of this git revision (a temporary worktree)")
    args = p.parse_args()

    worktree = None
    if args.against:
        worktree = tempfile.mkdtemp(prefix="lowmem-import-against-")
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", worktree, args.against], check=True, capture_output=True)
    try:
        todo = [(label, stmt, worktree if tree == "AGAINST" else tree) for label, stmt, tree in cases(args.against)]
        runs: dict[str, list[dict]] = {label: [] for label, _, _ in todo}
        for _ in range(args.repeats):
            for label, statement, tree in todo:  # alternating, so drift on shared cores spreads over every case
                runs[label].append(measure(statement, tree))
    finally:
        if worktree:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", worktree], check=False, capture_output=True)

    results = {label: summarize(r) for label, r in runs.items()}
    print(f"medians of {args.repeats} fresh processes; python {sys.version.split()[0]}")
    print(f"{'case':<56} {'time':>7} {'VmHWM':>10} {'RssAnon':>10} {'modules':>8}  heavy modules loaded")
    for label, r in results.items():
        print(
            f"{label:<56} {r['seconds']:>6.2f}s {r['vm_hwm_mib']:>6.0f} MiB {r['rss_anon_mib']:>6.0f} MiB "
            f"{r['modules']:>8}  {', '.join(r['heavy']) or '-'}"
        )
    print()
    ours = results["import lowmem_hf"]
    print(compare("import lowmem_hf vs import transformers", ours, results["import transformers"]))
    print(compare("import lowmem_hf vs import torch", ours, results["import torch"]))
    if args.against:
        print(compare(f"import lowmem_hf vs the same @{args.against}", ours, results[f"import lowmem_hf @{args.against}"]))
        first, then = "import lowmem_hf; .LowMemAutoModelForCausalLM", f"import lowmem_hf; .LowMemAutoModelForCausalLM @{args.against}"
        print(compare(f"first use vs the same @{args.against}", results[first], results[then]))


if __name__ == "__main__":
    main()
