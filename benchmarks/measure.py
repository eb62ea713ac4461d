"""The benchmarks' parent-side harness: several protocol children (the ranks of a parallel load) measured at once.

The protocol and one child's book-keeping are ``lowmem_hf.measured_load``'s (``lowmem-hf load`` measures one child
with them); ``/proc/<pid>/status`` is read by ``lowmem_hf.settings.proc_status``. This module adds what only the
benchmarks need: starting every rank together, the peak of the ranks' simultaneous sum, a timeout, and a
real-time sampler. See benchmarks/README.md for what the numbers mean.
"""

from __future__ import annotations

import os
import selectors
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Sequence

from lowmem_hf.measured_load import PREFIX, Child, read_status, reset_peak_rss

__all__ = [
    "PREFIX", "boost_sampler_priority", "free_port", "read_proc_status", "reset_peak_rss", "run_child", "run_children", "run_ranks",
    "spawn_child",
]


def read_proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory fields of /proc/<pid>/status, in kB. Raises OSError if the process is gone."""
    return read_status(pid)


def boost_sampler_priority() -> str:
    """Make this (parent) process a real-time SCHED_FIFO task so its 2 ms sampling wake-ups
    preempt a child that keeps every core busy (on 2 cores, gaps of 10-30 ms were seen without
    it). SCHED_RESET_ON_FORK: children started afterwards get the normal policy again, so the
    measured loads are not affected. The loop sleeps in select(), so it cannot hog a core.
    Needs root/CAP_SYS_NICE; returns the policy in effect ("SCHED_FIFO" or "normal")."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
        return "SCHED_FIFO"
    except (OSError, AttributeError):
        return "normal"


def _sample_all(children: list[Child], now: float) -> int | None:
    """Sample every loading child; the sum of their RssAnon above baseline (kB) when all of them are loading."""
    loading = [c for c in children if c.state == "loading"]
    total = 0
    for c in loading:
        st = c.sample(now)
        if st is not None:
            total += st.get("RssAnon", 0) - c.res["baseline"]["RssAnon"]
    return total if len(loading) == len(children) else None


def _start_or_abort(children: list[Child]) -> None:
    """Start everyone once all are READY, or abort those still waiting if one died first."""
    if children and all(c.state == "ready" for c in children):
        for c in children:
            c.start()
    if any(c.state == "done" for c in children):
        for c in children:
            if c.state in ("starting", "ready") and c.proc.poll() is None:
                c.error = c.error or "aborted: a sibling child died before the start"
                c.proc.kill()


def run_children(
    procs: Sequence[subprocess.Popen],
    *,
    interval_s: float = 0.002,
    start_together: bool = True,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Drive several protocol-following children at once and measure each of them.

    Each Popen must have been started with ``stdin=PIPE, stdout=PIPE`` (``spawn_child``). With ``start_together``
    the parent waits until every child is READY, then takes all baselines and sends "go" to all (so ranks load
    concurrently and no baseline is taken while a sibling is already loading).

    Returns one dict per child, in order (``lowmem_hf.measured_load.Child.finish``). With several children the
    first dict also gets "group": {"peak_sum_rss_anon_above_baseline_kb": ...} (peak of the simultaneous sum).
    """
    children = [Child(p, start_on_ready=not start_together) for p in procs]
    by_fd = {c.fd: c for c in children}
    sel = selectors.DefaultSelector()
    for c in children:
        os.set_blocking(c.fd, False)
        sel.register(c.fd, selectors.EVENT_READ)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    group_peak_sum = 0
    next_sample = time.monotonic()
    while any(c.state != "done" for c in children):
        now = time.monotonic()
        if deadline is not None and now > deadline:
            for c in children:
                if c.state != "done":
                    c.error = c.error or f"timeout after {timeout_s}s in state {c.state!r}"
                    c.proc.kill()
            deadline = None  # the kill produces EOFs; the loop reaps them
        if now >= next_sample:
            total = _sample_all(children, now)
            group_peak_sum = max(group_peak_sum, total or 0)
            next_sample = now + interval_s
        for key, _ in sel.select(max(0.0, next_sample - time.monotonic())):
            c = by_fd[key.fd]
            c.read_output()
            if c.state == "done":
                sel.unregister(c.fd)
        for c in children:  # a child that failed a protocol step is killed; its EOF reaps it
            if c.error and c.state != "done" and c.proc.poll() is None:
                c.proc.kill()
        if start_together:
            _start_or_abort(children)
    sel.close()
    results = [c.finish() for c in children]
    if len(children) > 1 and results:
        results[0]["group"] = {"peak_sum_rss_anon_above_baseline_kb": group_peak_sum}
    return results


def free_port() -> int:
    """A loopback port free now: the ranks' ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(commands: Sequence[tuple[Sequence[str], dict[str, str]]], logs: Sequence[Path], *, timeout_s: float | None = None) -> list[dict[str, Any]]:
    """The ranks of one parallel load: a protocol child per ``(argv, env)``, its stderr into the matching log, all
    started together and measured by ``run_children``; a child left running is killed. A failed rank raises
    ``RuntimeError`` naming it, with its stderr's tail."""
    procs = []
    try:
        for (argv, env), log in zip(commands, logs):
            with open(log, "w") as stderr:  # the child keeps its own descriptor
                procs.append(spawn_child(argv, env=env, stderr=stderr))
        got = run_children(procs, start_together=True, timeout_s=timeout_s)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (one, log) in enumerate(zip(got, logs)):
        if not one["ok"]:
            raise RuntimeError(f"rank {rank} of {len(got)} failed: {one['error']}; stderr tail ({log}):\n{Path(log).read_text()[-3000:]}")
    return got


def spawn_child(argv: Sequence[str], *, env=None, cwd=None, stderr=None) -> subprocess.Popen:
    """Start a protocol child with the pipes ``run_children`` expects."""
    return subprocess.Popen(
        list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env, cwd=cwd, bufsize=0,
    )


def run_child(
    argv: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    stderr=None,
    interval_s: float = 0.002,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Run one protocol child and return its measurements (see run_children)."""
    proc = spawn_child(argv, env=env, cwd=cwd, stderr=stderr)
    try:
        return run_children([proc], interval_s=interval_s, timeout_s=timeout_s)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
