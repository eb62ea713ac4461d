"""Parent-side memory measurement of child processes (stdlib only, Linux /proc): benchmarks and `lowmem-hf load`.

Why measure from the parent: a process cannot honestly sample its own peak while it is busy
loading (a sampler thread competes for the GIL, and in-process counters miss allocations made
by C++ / the kernel's mmap page-ins). The parent reads ``/proc/<pid>/status`` of the child,
which is what the kernel itself accounts.

Child protocol (one line per message on the child's stdout, prefixed with ``PREFIX``; the
parent answers with one line on the child's stdin). Any other stdout line is kept but ignored.

    child  -> "@@BENCH READY"          imports/warm-up done, child blocks on stdin
    parent    records the baseline, resets the kernel high-water mark, starts sampling
    parent -> "go"
    child  -> "@@BENCH LOADED"         the measured work is done, child blocks on stdin
    parent    stops sampling, snapshots /proc/<pid>/status (VmHWM = peak over the load)
    parent -> "go"
    child  -> "@@BENCH RESULT {json}"  post-load checks (not measured), child blocks on stdin
    parent -> "exit"
    child     exits with status 0

``run_children`` drives any number of such children at once (e.g. the ranks of a
tensor-parallel load), sampling all of them in one loop; ``run_child`` is the 1-process form.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from typing import Any, Sequence

PREFIX = "@@BENCH "

# Fields of /proc/<pid>/status we keep (all in kB).
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmSwap")


def read_proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory fields of /proc/<pid>/status, in kB. Raises OSError if the process is gone."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status", "rb") as f:
        data = f.read()
    for line in data.split(b"\n"):
        key, _, rest = line.partition(b":")
        k = key.decode()
        if k in STATUS_FIELDS:
            out[k] = int(rest.split()[0])
    return out


def reset_peak_rss(pid: int) -> bool:
    """Reset the kernel's VmHWM of ``pid`` to its current RSS (``echo 5 > clear_refs``, Linux>=4.0).

    Without this, VmHWM could still hold a transient peak from the imports and the "peak during
    the load" would be hidden under it. Returns False if the kernel/container refuses.
    """
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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


class _Child:
    """Book-keeping for one child process following the protocol."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pid = proc.pid
        self.fd = proc.stdout.fileno()
        self.buf = b""
        self.state = "starting"  # starting -> ready -> loading -> checking -> exiting -> done
        self.error: str | None = None
        self.other_stdout: list[str] = []
        self.res: dict[str, Any] = {"pid": proc.pid}
        self.peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
        self.n_samples = 0
        self.last_sample_t: float | None = None
        self.max_gap_s = 0.0
        self.t_go = 0.0

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:  # child died: noticed by EOF on stdout
            self.error = self.error or f"could not write to child stdin: {e}"

    def sample(self, now: float) -> dict[str, int] | None:
        try:
            st = read_proc_status(self.pid)
        except OSError:
            return None
        for k in self.peak:
            if st.get(k, 0) > self.peak[k]:
                self.peak[k] = st[k]
        if self.last_sample_t is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.last_sample_t)
        self.last_sample_t = now
        self.n_samples += 1
        return st


def _finish(c: _Child) -> dict[str, Any]:
    """Derive the headline numbers once the child is done."""
    r = c.res
    r["returncode"] = c.proc.returncode
    r["other_stdout"] = c.other_stdout[-50:]
    r["ok"] = c.error is None and c.proc.returncode == 0 and "result" in r
    if not r["ok"] and c.error is None:
        c.error = f"child exited with status {c.proc.returncode} in state {c.state!r}"
    r["error"] = c.error
    if "baseline" in r and "loaded" in r:
        base, loaded = r["baseline"], r["loaded"]
        # Include the LOADED snapshot in the peaks (the sampler may not have run after the
        # last allocation).
        for k in c.peak:
            c.peak[k] = max(c.peak[k], loaded.get(k, 0))
        r["peak_kb"] = dict(c.peak)
        r["n_samples"] = c.n_samples
        r["max_sample_gap_ms"] = round(c.max_gap_s * 1e3, 3)
        r["peak_rss_anon_above_baseline_kb"] = c.peak["RssAnon"] - base["RssAnon"]
        r["peak_rss_file_above_baseline_kb"] = c.peak["RssFile"] - base["RssFile"]
        # VmHWM is a high-water mark of the whole resident set (anon + file-backed mmap pages +
        # shmem). "Above baseline" = VmHWM at the end of the load minus the *current* RSS
        # (VmRSS) at the baseline, not minus VmHWM at the baseline: the latter may hold an
        # import-time transient. If the HWM reset worked, VmHWM restarted from VmRSS anyway.
        r["vmhwm_above_baseline_kb"] = loaded["VmHWM"] - base["VmRSS"]
    return r


def run_children(
    procs: Sequence[subprocess.Popen],
    *,
    interval_s: float = 0.002,
    start_together: bool = True,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Drive several protocol-following children at once and measure each of them.

    Each Popen must have been started with ``stdin=PIPE, stdout=PIPE`` (stderr anywhere but a
    pipe nobody reads, e.g. a log file). With ``start_together`` the parent waits until every
    child is READY, then takes all baselines and sends "go" to all (so ranks load concurrently
    and no baseline is taken while a sibling is already loading).

    Returns one dict per child (same order): "baseline"/"loaded" status snapshots (kB),
    "baseline_vmhwm_kb" (VmHWM before the reset), "hwm_reset", "peak_kb" (max sampled
    RssAnon/RssFile/VmRSS), "peak_rss_anon_above_baseline_kb", "vmhwm_above_baseline_kb",
    "parent_load_seconds" (go -> LOADED as seen by the parent), "result" (the child's JSON),
    "ok", "error", "returncode". If there are several children, the first dict also gets
    "group": {"peak_sum_rss_anon_above_baseline_kb": ...} (peak of the simultaneous sum).
    """
    children = [_Child(p) for p in procs]
    by_fd = {c.fd: c for c in children}
    sel = selectors.DefaultSelector()
    for c in children:
        os.set_blocking(c.fd, False)
        sel.register(c.fd, selectors.EVENT_READ)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    group_peak_sum = 0
    next_sample = time.monotonic()

    def start(c: _Child) -> None:
        # The child is blocked on stdin: its memory is stable, so this is the baseline.
        try:
            c.res["baseline_vmhwm_kb"] = read_proc_status(c.pid)["VmHWM"]
            c.res["hwm_reset"] = reset_peak_rss(c.pid)
            c.res["baseline"] = read_proc_status(c.pid)
        except OSError as e:
            c.error = f"child vanished at baseline: {e}"
            return
        c.state = "loading"
        c.t_go = time.perf_counter()
        c.sample(time.monotonic())
        c.send("go")

    def handle_line(c: _Child, line: str) -> None:
        if not line.startswith(PREFIX):
            c.other_stdout.append(line)
            return
        msg = line[len(PREFIX):]
        if msg == "READY" and c.state == "starting":
            c.state = "ready"
            if not start_together:
                start(c)
        elif msg == "LOADED" and c.state == "loading":
            c.res["parent_load_seconds"] = time.perf_counter() - c.t_go
            st = c.sample(time.monotonic())  # child is blocked again: exact end-of-load state
            if st is None:
                c.error = "child vanished at LOADED"
                return
            c.res["loaded"] = st
            c.state = "checking"
            c.send("go")
        elif msg.startswith("RESULT ") and c.state == "checking":
            try:
                c.res["result"] = json.loads(msg[len("RESULT "):])
            except json.JSONDecodeError as e:
                c.error = f"bad RESULT json: {e}"
            c.state = "exiting"
            c.send("exit")
        else:
            c.error = c.error or f"unexpected message {msg[:80]!r} in state {c.state!r}"

    while any(c.state != "done" for c in children):
        now = time.monotonic()
        if deadline is not None and now > deadline:
            for c in children:
                if c.state != "done":
                    c.error = c.error or f"timeout after {timeout_s}s in state {c.state!r}"
                    c.proc.kill()
            deadline = None  # the kill produces EOFs; let the loop reap them

        # 1. Sample every loading child on a fixed cadence.
        if now >= next_sample:
            loading = [c for c in children if c.state == "loading"]
            total = 0
            for c in loading:
                st = c.sample(now)
                if st is not None:
                    total += st.get("RssAnon", 0) - c.res["baseline"]["RssAnon"]
            if len(loading) == len(children):
                group_peak_sum = max(group_peak_sum, total)
            next_sample = now + interval_s

        # 2. Wait for child output at most until the next sample is due.
        for key, _ in sel.select(max(0.0, next_sample - time.monotonic())):
            c = by_fd[key.fd]
            try:
                chunk = os.read(c.fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:  # EOF: the child exited (normally after "exit", or crashed)
                sel.unregister(c.fd)
                try:
                    c.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
                if c.state != "exiting":
                    c.error = c.error or (
                        f"child exited with status {c.proc.returncode} in state {c.state!r}"
                    )
                c.state = "done"
                continue
            c.buf += chunk
            while b"\n" in c.buf:
                raw, c.buf = c.buf.split(b"\n", 1)
                handle_line(c, raw.decode(errors="replace").rstrip("\r"))

        # A child that failed a protocol step (error set) is killed; the EOF reaps it.
        for c in children:
            if c.error and c.state not in ("done",) and c.proc.poll() is None:
                c.proc.kill()

        # 3. Start everyone together once all are READY (or abort if one died first).
        if start_together and children and all(c.state == "ready" for c in children):
            for c in children:
                start(c)
        if start_together and any(c.state == "done" for c in children):
            for c in children:
                if c.state in ("starting", "ready") and c.proc.poll() is None:
                    c.error = c.error or "aborted: a sibling child died before the start"
                    c.proc.kill()

    sel.close()
    results = [_finish(c) for c in children]
    if len(children) > 1 and results:
        results[0]["group"] = {"peak_sum_rss_anon_above_baseline_kb": group_peak_sum}
    return results


def spawn_child(argv: Sequence[str], *, env=None, cwd=None, stderr=None) -> subprocess.Popen:
    """Start a protocol child with the pipes ``run_children`` expects."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        cwd=cwd,
        bufsize=0,
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
    """Run one protocol child (see module doc) and return its measurements (see run_children)."""
    proc = spawn_child(argv, env=env, cwd=cwd, stderr=stderr)
    try:
        return run_children([proc], interval_s=interval_s, timeout_s=timeout_s)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
