#!/usr/bin/env python
"""Run transformers' own loading tests through lowmem_hf's switch and hold them to the plain run's results.

    python tests/upstream/run_transformers_tests.py [--shared ../shared/transformers-tests] [-n 2]

One command: unpack the shared tree of transformers 5.23.0's tests into a temporary folder, re-create the
offline Hub cache its tests load (the shared ``make_hub_cache.py``), run the selected tests with
``lowmem_hf.patch_transformers()`` on (``switch_plugin.py``), and compare with
``expected_pass-<version>.txt``: every test listed there (it passed without the switch) must pass with it, and
the loads lowmem_hf served must not fall below the file's ``# served_floor:``. Exit 1 otherwise.

With a transformers other than the one the file was made for, it prints why and exits 0 without running:
the tests are that release's.

``--mode plain --update-expected`` re-makes the expected file from a run without the switch (see README.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

TRANSFORMERS_VERSION = "5.23.0"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXPECTED = HERE / f"expected_pass-{TRANSFORMERS_VERSION}.txt"
TARBALL = "tf-tests-5.23.tgz"

# tests/utils/test_modeling_utils.py whole, and the mixins' save/load/init/tying tests of these architectures
# (the -k of the shared README; "test_modeling_utils" keeps every test of that file)
MODELS = ("llama", "bert", "bart", "t5", "gpt2", "mistral", "qwen2", "opt", "vit", "clip", "whisper")
KEYWORDS = "test_modeling_utils or save or load or pretrained or tied or init or keep_in"
# what the upstream tests import beyond lowmem_hf's own dependencies (pip name: module)
TEST_DEPS = {"pytest-xdist": "xdist", "pytest-timeout": "pytest_timeout", "parameterized": "parameterized",
             "httpx": "httpx", "requests": "requests", "timeout-decorator": "timeout_decorator", "psutil": "psutil"}


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def read_expected(path: Path) -> tuple[list[str], int]:
    """The test ids of an expected file, and its ``# served_floor: N``."""
    tests, floor = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line.startswith("# served_floor:"):
            floor = int(line.split(":", 1)[1])
        elif line and not line.startswith("#"):
            tests.append(line)
    if floor is None:
        raise SystemExit(f"{path}: no '# served_floor: N' line")
    return tests, floor


def write_expected(path: Path, summary: dict, served_floor: int, command: str) -> None:
    passed = sorted(k for k, v in summary["tests"].items() if v["outcome"] == "passed")
    header = [
        f"# transformers {summary['transformers']} tests that pass WITHOUT lowmem_hf's switch (plain run), torch "
        f"{summary['torch']}, made by:",
        f"#   {command}",
        "# Each must also pass with the switch on (run_transformers_tests.py). Tests that fail or skip plain are not",
        "# listed. served_floor: the fewest loads lowmem_hf must serve in the switched run (guards a switch that",
        "# silently stopped applying); set with --served-floor, about 90% of what a switched run served.",
        f"# served_floor: {served_floor}",
    ]
    path.write_text("\n".join(header + passed) + "\n", encoding="utf-8")


def prepare_tree(shared: Path, work: Path) -> tuple[Path, Path]:
    """Unpack the tests, point ``src/transformers`` at the installed package, build the offline Hub cache."""
    tree = work / "tftests"
    tree.mkdir()
    with tarfile.open(shared / TARBALL) as tar:
        try:
            tar.extractall(tree, filter="data")
        except TypeError:  # a Python without extraction filters (before 3.10.12 / 3.11.4)
            tar.extractall(tree)
    # tests/test_pipeline_mixin.py imports ``<root>/src/transformers`` by path: the installed 5.23.0 (same files as
    # the sdist's src/), so the tests and lowmem_hf see one transformers
    import transformers

    (tree / "src").mkdir(exist_ok=True)
    (tree / "src" / "transformers").symlink_to(Path(transformers.__file__).parent, target_is_directory=True)
    hf_home = work / "hf_home"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    done = subprocess.run([sys.executable, str(shared / "make_hub_cache.py"), str(hf_home)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        _say(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"make_hub_cache.py failed (exit {done.returncode})")
    return tree, hf_home


def run_pytest(tree: Path, hf_home: Path, work: Path, mode: str, workers: int, timeout: int, extra: list[str]):
    report = work / f"{mode}.json"
    log = work / f"{mode}.log"
    files = ["tests/utils/test_modeling_utils.py"] + [f"tests/models/{m}/test_modeling_{m}.py" for m in MODELS]
    cmd = [
        sys.executable, "-m", "pytest", *files, "-k", KEYWORDS,
        "-p", "switch_plugin", f"--lowmem-switch={'on' if mode == 'switched' else 'off'}", f"--lowmem-report={report}",
        # the tree's pyproject adds doctests of every .md and live logging; neither is a loading test
        "-o", "addopts=", "-o", "log_cli=0", "-p", "no:cacheprovider", "-p", "no:warnings",
        "-q", "-rfE", f"--timeout={timeout}", *(["-n", str(workers)] if workers > 1 else []), *extra,
    ]
    env = dict(
        os.environ,
        HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        TMPDIR=str(work / "tmp"),
    )
    (work / "tmp").mkdir(exist_ok=True)
    _say(f"$ cd {tree} && {shlex.join(cmd)}\n  (log: {log})")
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    seconds = time.monotonic() - started
    tail = [l for l in log.read_text(encoding="utf-8", errors="replace").splitlines() if l.strip()][-1:]
    _say(f"pytest exit {rc} after {seconds:.0f} s: {tail[0] if tail else ''}")
    if not report.exists():
        _say(log.read_text(encoding="utf-8", errors="replace")[-6000:])
        raise SystemExit(f"pytest wrote no summary ({report}); exit {rc}")
    return rc, json.loads(report.read_text(encoding="utf-8")), seconds, log


def judge(summary: dict, expected: list[str], floor: int) -> list[str]:
    """Print the comparison; return the problems (empty: the switch holds the contract)."""
    tests, totals = summary["tests"], summary["totals"]
    switched_pass = [k for k, v in tests.items() if v["outcome"] == "passed"]
    regressions = [k for k in expected if tests.get(k, {}).get("outcome") != "passed"]
    _say()
    _say(f"plain-pass (expected file):   {len(expected)}")
    _say(f"switched-pass:                {len(switched_pass)} of {len(tests)} run "
         f"({len(expected) - len(regressions)} of the expected)")
    _say(f"loads served by lowmem_hf:    {totals['served']} in {totals['tests_with_served_load']} tests "
         f"(floor {floor})")
    _say(f"handed to transformers:       {totals['fallbacks']}")
    for argument, n in totals["fallback_reasons"].items():
        example = next(f["reason"] for t in tests.values() for f in t["fallbacks"] if str(f["argument"]) == argument)
        _say(f"  {n:4d} x {argument}: {example[:160]}")
    _say(f"raised through the switch:    {totals['raised']} (a test may expect the exception)")
    for stage, n in totals["raised_by_stage"].items():
        _say(f"  {n:4d} x {stage}")
    problems = []
    if regressions:
        _say()
        _say(f"REGRESSIONS: {len(regressions)} test(s) pass without the switch but not with it:")
        for k in regressions:
            t = tests.get(k)
            if t is None:
                _say(f"  {k}\n      not run (not collected: renamed, or deselected?)")
                continue
            raised = "; ".join(f"{r['stage']}: {r['type']}" for r in t["raised"])
            _say(f"  {k}  [{t['outcome']}]\n      {(t['message'] or '')[:300]}" + (f"\n      raised: {raised}" if raised else ""))
        problems.append(f"{len(regressions)} expected test(s) do not pass switched")
    if totals["served"] < floor:
        problems.append(f"lowmem_hf served {totals['served']} loads, below the floor of {floor}")
    if totals["unaccounted"]:
        problems.append(f"{totals['unaccounted']} switched call(s) the plugin could not classify (see the JSON)")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shared", type=Path, default=REPO.parent / "shared" / "transformers-tests",
                        help="folder with tf-tests-5.23.tgz and make_hub_cache.py (default: %(default)s)")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers (1: none)")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout, seconds")
    parser.add_argument("--mode", choices=("switched", "plain"), default="switched")
    parser.add_argument("--update-expected", action="store_true",
                        help="with --mode plain: rewrite the expected file from this run")
    parser.add_argument("--served-floor", type=int, help="with --update-expected: the floor to write")
    parser.add_argument("--report", type=Path, help="also copy the JSON summary here")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (tree, cache, logs)")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest (after --)")
    args = parser.parse_args(argv)

    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed != TRANSFORMERS_VERSION:
        _say(f"SKIPPED: these are transformers {TRANSFORMERS_VERSION}'s tests and the expected results were made "
             f"with it; installed transformers is {installed}. Nothing was run.")
        return 0
    if args.update_expected and args.mode != "plain":
        parser.error("--update-expected needs --mode plain (the expected list is what passes without the switch)")
    missing = [pip for pip, mod in TEST_DEPS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        _say(f"transformers' tests need: pip install {' '.join(missing)}")
        return 2
    shared = args.shared.resolve()
    if not (shared / TARBALL).is_file() or not (shared / "make_hub_cache.py").is_file():
        _say(f"{shared} lacks {TARBALL} or make_hub_cache.py (pass --shared)")
        return 2
    expected, floor = ([], 0) if args.update_expected else read_expected(EXPECTED)

    work = Path(tempfile.mkdtemp(prefix="tftests-"))
    started = time.monotonic()
    try:
        tree, hf_home = prepare_tree(shared, work)
        _say(f"tree and offline Hub cache ready in {time.monotonic() - started:.0f} s ({work})")
        rc, summary, _, _ = run_pytest(tree, hf_home, work, args.mode, args.workers, args.timeout, args.pytest_args)
        if args.report:
            shutil.copy(work / f"{args.mode}.json", args.report)
        if rc not in (0, 1):  # interrupted, internal error, usage error, no tests: the run itself is broken
            _say((work / f"{args.mode}.log").read_text(encoding="utf-8", errors="replace")[-6000:])
            _say(f"FAIL: pytest exited {rc}")
            return 1
        if args.update_expected:
            floor = args.served_floor if args.served_floor is not None else read_expected(EXPECTED)[1]
            command = f"python tests/upstream/run_transformers_tests.py --mode plain --update-expected --served-floor {floor}"
            write_expected(EXPECTED, summary, floor, command)
            n = sum(1 for v in summary["tests"].values() if v["outcome"] == "passed")
            _say(f"wrote {EXPECTED} ({n} tests passing plain, served_floor {floor})")
            return 0
        if args.mode == "plain":
            totals = summary["totals"]
            _say(f"plain run: {totals['outcomes']}")
            return 0
        problems = judge(summary, expected, floor)
        _say()
        _say(f"total {time.monotonic() - started:.0f} s")
        if problems:
            _say("FAIL: " + "; ".join(problems))
            return 1
        _say(f"OK: all {len(expected)} expected tests pass with the switch; {summary['totals']['served']} loads served")
        return 0
    finally:
        if args.keep:
            _say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
