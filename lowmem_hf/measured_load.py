"""A load measured from outside its process, for ``lowmem-hf load``: the child, the parent's sampler, the picture.

A process cannot honestly sample its own peak while it is busy loading (a sampler thread competes for the GIL,
and in-process counters miss what C++ and the kernel's page-ins allocate), so the parent reads the child's
``/proc/<pid>/status``, which is what the kernel itself accounts. The two talk in lines on the child's stdout,
each prefixed with ``PREFIX``, answered by one line on its stdin; other stdout lines are kept but ignored:

    child  -> "@@BENCH READY"          imports done, the model's module imported; blocks on stdin
    parent    records the baseline, resets the kernel high-water mark, starts sampling
    parent -> "go"
    child  -> "@@BENCH LOADED"         the measured work is done; blocks on stdin
    parent    stops sampling, snapshots /proc/<pid>/status (VmHWM = peak over the load)
    parent -> "go"
    child  -> "@@BENCH RESULT {json}"  post-load checks, not measured; blocks on stdin
    parent -> "exit"

``benchmarks/measure.py`` drives several such children at once (the ranks of a parallel load) with ``Child``.
The child here is ``python -m lowmem_hf.measured_load --loader lowmem|transformers|bare MODEL ...``; ``bare`` reads
and converts the weight files named by ``--files`` with the plain libraries and no model (what a comparison
reads both loaders against).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

from .settings import proc_status

__all__ = ["PREFIX", "Child", "read_status", "reset_peak_rss", "run_child", "draw_memory_over_time", "main"]

PREFIX = "@@BENCH "
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmSwap")
"""The fields of ``/proc/<pid>/status`` a snapshot keeps, in kB."""


def read_status(pid: int | str) -> dict[str, int]:
    """``STATUS_FIELDS`` of ``/proc/<pid>/status`` in kB. Raises OSError if the process is gone."""
    return proc_status(pid, STATUS_FIELDS)


def reset_peak_rss(pid: int) -> bool:
    """Reset the kernel's VmHWM of ``pid`` to its current RSS (``echo 5 > clear_refs``, Linux >= 4.0), so that a
    transient peak of the imports cannot hide the load's. False where the kernel or the container refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Child:
    """One child following the protocol: its state, its samples and, at the end, its measurements (``finish``)."""

    def __init__(self, proc: subprocess.Popen, *, keep_series: bool = False, start_on_ready: bool = True):
        self.keep_series = keep_series
        self.start_on_ready = start_on_ready  # False where a driver starts several children together
        self.proc, self.pid, self.fd = proc, proc.pid, proc.stdout.fileno()
        self.buf = b""
        self.state = "starting"  # starting -> ready -> loading -> checking -> exiting -> done
        self.error: str | None = None
        self.other_stdout: list[str] = []
        self.res: dict[str, Any] = {"pid": proc.pid}
        self.peak = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
        self.series: list[tuple[float, int, int]] = []  # (seconds since go, RssAnon kB, VmHWM kB)
        self.n_samples, self.max_gap_s, self.t_go = 0, 0.0, 0.0
        self.last_sample_t: float | None = None

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write((line + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:  # the child died: its EOF on stdout says so
            self.error = self.error or f"could not write to child stdin: {e}"

    def sample(self, now: float) -> dict[str, int] | None:
        try:
            st = read_status(self.pid)
        except OSError:
            return None
        for k in self.peak:
            self.peak[k] = max(self.peak[k], st.get(k, 0))
        if self.last_sample_t is not None:
            self.max_gap_s = max(self.max_gap_s, now - self.last_sample_t)
        self.last_sample_t = now
        self.n_samples += 1
        if self.keep_series:
            self.series.append((time.perf_counter() - self.t_go, st.get("RssAnon", 0), st.get("VmHWM", 0)))
        return st

    def start(self) -> None:
        """Baseline, reset the high-water mark and say go: the child is blocked on stdin, its memory stable."""
        try:
            self.res["baseline_vmhwm_kb"] = read_status(self.pid)["VmHWM"]
            self.res["hwm_reset"] = reset_peak_rss(self.pid)
            self.res["baseline"] = read_status(self.pid)
        except OSError as e:
            self.error = f"child vanished at baseline: {e}"
            return
        self.state = "loading"
        self.t_go = time.perf_counter()
        self.sample(time.monotonic())
        self.send("go")

    def handle_line(self, line: str) -> None:
        if not line.startswith(PREFIX):
            self.other_stdout.append(line)
            return
        msg = line[len(PREFIX):]
        if msg == "READY" and self.state == "starting":
            self.state = "ready"
            if self.start_on_ready:
                self.start()
        elif msg == "LOADED" and self.state == "loading":
            self.res["parent_load_seconds"] = time.perf_counter() - self.t_go
            st = self.sample(time.monotonic())  # the child is blocked again: the exact end-of-load state
            if st is None:
                self.error = "child vanished at LOADED"
                return
            self.res["loaded"], self.state = st, "checking"
            self.send("go")
        elif msg.startswith("RESULT ") and self.state == "checking":
            try:
                self.res["result"] = json.loads(msg[len("RESULT "):])
            except json.JSONDecodeError as e:
                self.error = f"bad RESULT json: {e}"
            self.state = "exiting"
            self.send("exit")
        else:
            self.error = self.error or f"unexpected message {msg[:80]!r} in state {self.state!r}"

    def read_output(self) -> None:
        """Read what the child wrote and act on each whole line; at EOF reap it (state ``done``)."""
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return
        if not chunk:  # the child exited (after "exit", or crashed)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if self.state != "exiting":
                self.error = self.error or f"child exited with status {self.proc.returncode} in state {self.state!r}"
            self.state = "done"
            return
        self.buf += chunk
        while b"\n" in self.buf:
            raw, self.buf = self.buf.split(b"\n", 1)
            self.handle_line(raw.decode(errors="replace").rstrip("\r"))

    def finish(self) -> dict[str, Any]:
        """The measurements: "baseline"/"loaded" snapshots (kB), "peak_kb", "peak_rss_anon_above_baseline_kb",
        "vmhwm_above_baseline_kb", "result" (the child's JSON), "ok", "error", "returncode"; with ``keep_series``,
        "series": (seconds since go, RssAnon and VmHWM above the baseline in kB) per sample."""
        r = self.res
        r["returncode"] = self.proc.returncode
        r["other_stdout"] = self.other_stdout[-50:]
        r["ok"] = self.error is None and self.proc.returncode == 0 and "result" in r
        if not r["ok"] and self.error is None:
            self.error = f"child exited with status {self.proc.returncode} in state {self.state!r}"
        r["error"] = self.error
        if "baseline" in r and "loaded" in r:
            base, loaded = r["baseline"], r["loaded"]
            for k in self.peak:  # the sampler may not have run after the last allocation
                self.peak[k] = max(self.peak[k], loaded.get(k, 0))
            r["peak_kb"] = dict(self.peak)
            r["n_samples"] = self.n_samples
            r["max_sample_gap_ms"] = round(self.max_gap_s * 1e3, 3)
            r["peak_rss_anon_above_baseline_kb"] = self.peak["RssAnon"] - base["RssAnon"]
            r["peak_rss_file_above_baseline_kb"] = self.peak["RssFile"] - base["RssFile"]
            # VmHWM counts the whole resident set (anon, file-backed mappings, shmem). Above the baseline means
            # minus the baseline's current RSS, not its VmHWM, which may hold an import-time transient.
            r["vmhwm_above_baseline_kb"] = loaded["VmHWM"] - base["VmRSS"]
            if self.keep_series:
                r["series"] = [(t, anon - base["RssAnon"], hwm - base["VmRSS"]) for t, anon, hwm in self.series]
        return r


def run_child(argv: Sequence[str], *, stderr=None, interval_s: float = 0.002, keep_series: bool = False) -> dict[str, Any]:
    """Run one protocol child and return its measurements (``Child.finish``), sampling every ``interval_s``."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, bufsize=0)
    child = Child(proc, keep_series=keep_series)
    os.set_blocking(child.fd, False)
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(child.fd, selectors.EVENT_READ)
            next_sample = time.monotonic()
            while child.state != "done":
                now = time.monotonic()
                if now >= next_sample:
                    if child.state == "loading":
                        child.sample(now)
                    next_sample = now + interval_s
                if sel.select(max(0.0, next_sample - time.monotonic())):
                    child.read_output()
                if child.error and child.state != "done" and proc.poll() is None:
                    proc.kill()  # a failed protocol step: the EOF reaps it
        return child.finish()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def draw_memory_over_time(loads: list[dict], path: str, *, title: str) -> None:
    """Draw each load's sampled RssAnon and VmHWM above its baseline against seconds since its start into a PNG.

    ``loads`` are ``lowmem-hf load``'s entries: "loader", "model_bytes" and "series" (seconds, bytes, bytes).
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: a file is the product
    from matplotlib import pyplot

    gib = 1024**3
    fig, ax = pyplot.subplots(figsize=(8, 4.2), dpi=100)
    colors = {"lowmem": "tab:blue", "transformers": "tab:orange"}
    names = {"lowmem": "lowmem_hf", "transformers": "transformers"}
    for load in loads:
        t = [s[0] for s in load["series"]]
        color, name = colors.get(load["loader"]), names.get(load["loader"], load["loader"])
        ax.plot(t, [s[1] / gib for s in load["series"]], color=color, lw=1.8, label=f"{name} RssAnon")
        ax.plot(t, [s[2] / gib for s in load["series"]], color=color, lw=1.4, ls="--", label=f"{name} VmHWM")
    ax.axhline(loads[0]["model_bytes"] / gib, color="gray", lw=0.8, ls=":", label="final model bytes")
    ax.set_xlabel("seconds since the load began")
    ax.set_ylabel("GiB above the post-import baseline")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", ncol=2)
    fig.tight_layout()
    fig.savefig(path, format="png")
    pyplot.close(fig)


# ---- the child: one loader, one request ----------------------------------------------------------------


def _say(message: str) -> None:
    sys.stdout.write(PREFIX + message + "\n")
    sys.stdout.flush()


def _wait(expected: str) -> None:
    line = sys.stdin.readline().strip()
    if line != expected:
        raise SystemExit(f"expected {expected!r} from the parent, got {line!r}")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _child_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lowmem_hf.measured_load")
    p.add_argument("model")
    p.add_argument("--loader", choices=["lowmem", "transformers", "bare"], required=True)
    p.add_argument("--auto-class", default="AutoModelForCausalLM")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dtype-policy", default="declared")
    p.add_argument("--revision")
    p.add_argument("--fetch", default="files")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--files", nargs="*", default=[], help="bare: the local weight files to read")
    return p.parse_args(argv)


def bare_files_supported(files: Sequence[str]) -> bool:
    """Whether ``bare`` can read these weight files (safetensors or ``torch.save`` ones)."""
    return bool(files) and all(f.endswith((".safetensors", ".bin")) for f in files)


def read_and_convert(files: Sequence[str], dtype) -> tuple[int, list[Any]]:
    """Every tensor of ``files`` read and converted into fresh memory of ``dtype`` (None: its stored dtype), on as many
    threads as there are cores, and nothing else: the bytes any load of the request must read and write. Returns the
    bytes held and the tensors (kept alive until the parent has sampled the peak)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors import safe_open

    def convert(t):
        return torch.empty(t.shape, dtype=dtype or t.dtype).copy_(t)  # a copy even where the dtype does not change

    handles, futures = [], []
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for file in files:
            if file.endswith(".safetensors"):
                handle = safe_open(file, framework="pt")
                handles.append(handle)
                futures += [pool.submit(lambda h, k: convert(h.get_tensor(k)), handle, k) for k in handle.keys()]
            else:
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                futures += [pool.submit(convert, t) for t in state.values()]
        tensors = [f.result() for f in futures]
    return sum(t.numel() * t.element_size() for t in tensors), tensors


def main(argv: list[str] | None = None) -> int:
    """The child: imports and the model's module before READY, so neither loader is charged for them; under
    torchrun it inherits the launcher's environment and joins the process group itself."""
    args = _child_args(argv)
    import torch
    import transformers

    import lowmem_hf
    import lowmem_hf.load  # noqa: F401 - the package imports its stages on first use: before the baseline
    from lowmem_hf.assign import model_nbytes
    from lowmem_hf.compat.transformers_api import model_class_for

    auto = getattr(transformers, args.auto_class)
    if lowmem_hf.resolve_store.is_store_url(args.model):  # transformers reads the config of a local copy
        with tempfile.TemporaryDirectory(prefix="lowmem-config-") as folder:
            config = transformers.AutoConfig.from_pretrained(lowmem_hf.fetch_small_files(args.model, folder), revision=args.revision)
    else:
        config = transformers.AutoConfig.from_pretrained(args.model, revision=args.revision)
    model_class_for(config, auto)  # imports the model's module before the clock, for both loaders
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    tp = {"tp_plan": "auto"} if args.tp_size > 1 else {}
    _say("READY")
    _wait("go")

    rchar = _rchar()
    start = time.perf_counter()
    if args.loader == "bare":
        model_bytes, model = read_and_convert(args.files, None if args.dtype == "auto" else dtype)
        report, info = None, {"missing_keys": [], "unexpected_keys": []}
    elif args.loader == "lowmem":
        model, report = getattr(lowmem_hf, "LowMem" + args.auto_class).from_pretrained(
            args.model, torch_dtype=dtype, dtype_policy=args.dtype_policy, revision=args.revision, fetch=args.fetch,
            output_loading_info=True, **tp,
        )
        info = report.to_dict()
    else:
        model, info = auto.from_pretrained(args.model, dtype=dtype, revision=args.revision, output_loading_info=True, **tp)
    seconds = time.perf_counter() - start
    rchar = _rchar() - rchar
    _say("LOADED")
    _wait("go")

    _say("RESULT " + json.dumps({
        "seconds": seconds,
        "rchar": rchar,
        "bytes_read": report.bytes_read if args.loader == "lowmem" else None,
        "model_bytes": model_bytes if args.loader == "bare" else model_nbytes(model),
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "rank": torch.distributed.get_rank() if torch.distributed.is_initialized() else 0,
    }))
    _wait("exit")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
