"""Warm local files are converted straight from mapped windows under a kernel read lease: a file truncated, rewritten
or replaced under the load is a named error, never a SIGBUS or a hang, and without a lease the load is the same.

The damage comes from another process, as it would in life. A read lease makes its ``open`` for writing or its
``truncate`` wait until lowmem_hf gives the lease up, which it does only once no mapped window of the file is in use;
each test holds a window for 0.3 s while the writer waits, then reads it.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from lowmem_hf.auto import AUTO_CLASSES
from lowmem_hf.formats import StreamStats
from lowmem_hf.sources.lease import LeaseWatch
from lowmem_hf.sources.local import LocalFiles

Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]


def weight_files(folder) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith((".safetensors", ".bin")))


def writers_open(folder):
    """Every weight file of ``folder`` open for writing by this process: no read lease can be had on them."""
    return [open(f, "ab") for f in weight_files(folder)]


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
def test_without_a_lease_the_load_is_bit_identical_and_says_why(make_checkpoint, fmt):
    path = make_checkpoint("llama", fmt)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    mapped = Causal.from_pretrained(path, torch_dtype=torch.bfloat16)
    writers = writers_open(path)
    try:
        unleased = Causal.from_pretrained(path, torch_dtype=torch.bfloat16)
    finally:
        for w in writers:
            w.close()
    got, without = mapped.lowmem_report, unleased.lowmem_report
    assert got.mapped_lease_bytes > 0 and got.preadv_reasons == {}
    assert without.mapped_lease_bytes == 0 and without.preadv_bytes >= got.mapped_lease_bytes
    assert sorted(without.preadv_reasons) == weight_files(path)
    assert all("open for writing" in why for why in without.preadv_reasons.values())
    for name, t in ref.items():
        assert torch.equal(mapped.state_dict()[name], t), name
        assert torch.equal(unleased.state_dict()[name], t), name


def test_a_lease_broken_between_reads_is_given_up_at_once(tmp_path):
    # nothing reads the file when the writer comes: the watching thread, signalled by the kernel, lets it go on
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    files = LocalFiles(mapped_reads=True)
    with files.mapped(str(path), 0, 4096) as window:
        assert window is not None and bytes(window[:16].numpy()) == path.read_bytes()[:16]
    waited = _truncate_in_another_process(path)
    with files.mapped(str(path), 0, 4096) as window:
        assert window is None  # the lease is gone: preadv from here on
    files.close()
    assert waited < 2.0, f"the writer waited {waited:.2f} s for the lease (break time: 45 s)"


def _truncate_in_another_process(path) -> float:
    code = f"import os, time; t = time.perf_counter(); os.truncate({str(path)!r}, 0); print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout)


def test_no_lease_is_taken_where_the_kernel_refuses_it(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 8192)
    with open(path, "ab"):
        files = LocalFiles(mapped_reads=True)
        with files.mapped(str(path), 0, 4096) as window:
            assert window is None
        files.close()
    assert "open for writing" in files.preadv_reasons[str(path)]


def test_a_break_time_too_short_for_a_mapped_read_takes_no_lease(monkeypatch):
    from lowmem_hf.sources import lease

    monkeypatch.setattr(lease, "_break_seconds", lambda: 1)
    assert "lease-break-time is 1 s" in LeaseWatch(watch=False).refusal


# A child loads a private copy of the checkpoint; when a mapped window of the target file opens (the first, the
# middle or the last of that file), another process starts to damage the file, the window is held 0.3 s (the writer
# waits for the lease meanwhile) and then read, and after it the child waits for the writer to finish, so the rest of
# the load meets the damaged file. Any SIGBUS kills the child (-7).
_CHILD = textwrap.dedent(r"""
    import contextlib, os, shutil, subprocess, sys, threading, time, torch
    from lowmem_hf import CorruptCheckpointError
    from lowmem_hf.auto import AUTO_CLASSES
    from lowmem_hf.sources.local import LocalFiles

    source, work, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]
    original = LocalFiles.mapped
    windows, state, lock = {}, {}, threading.Lock()

    DAMAGE = {
        "truncate": "os.truncate(path, 4096)",
        "rewrite": "f = open(path, 'r+b'); f.seek(0, 2); n = f.tell(); f.seek(n // 2); f.write(os.urandom(n - n // 2)); f.close()",
        "rename": "shutil.copy(path, path + '.new'); os.replace(path + '.new', path)",
    }

    @contextlib.contextmanager
    def watched(self, file, start, stop):
        mine = False
        with original(self, file, start, stop) as window:
            if window is not None:
                with lock:
                    i = windows[file] = windows.get(file, 0) + 1
                if file == state.get("target") and i == state["at"]:
                    mine = True
                    code = f"import os, shutil, time; path = {file!r}; {DAMAGE[state['how']]}; print(time.time())"
                    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
                    time.sleep(0.3)  # the writer is blocked in open/truncate now (or done, for a rename)
            yield window
            held_until = time.time()  # the window is still mapped, the lease still held
        if mine:  # the rest of the load meets the damaged file
            state["waited"] = float(writer.communicate(timeout=20)[0]) - held_until

    LocalFiles.mapped = watched
    for name in os.listdir(source):  # warm: mapped reads are for files in the page cache
        open(os.path.join(source, name), "rb").read()
    clean = Causal.from_pretrained(source, torch_dtype=torch.bfloat16)
    files = sorted(f for f in windows if f.endswith((".safetensors", ".bin")))
    counts = {os.path.basename(f): windows[f] for f in files}
    target = max(counts, key=counts.get)  # the file with the most windows
    for case in cases:
        how, where = case.split("-")
        folder = os.path.join(work, case)
        shutil.copytree(source, folder)
        for name in os.listdir(folder):
            open(os.path.join(folder, name), "rb").read()
        windows.clear()
        state.clear()
        state.update(target=os.path.join(folder, target), how=how, at={"start": 1, "middle": counts[target] // 2, "end": counts[target]}[where])
        try:
            got = Causal.from_pretrained(folder, torch_dtype=torch.bfloat16)
            same = all(torch.equal(got.state_dict()[k], v) for k, v in clean.state_dict().items())
            outcome = f"LOADED same={same}"
        except CorruptCheckpointError as e:
            outcome = "NAMED " + str(e).replace("\n", " ")
        print(case, f"windows={counts[target]} at={state['at']} writer_done_after_window={state.get('waited', -1):.3f}", outcome, flush=True)
""")


@pytest.mark.parametrize(
    "fmt,threads",
    [("sharded", "reader threads"), ("bin", "reader threads"), ("sharded", "HF_DEACTIVATE_ASYNC_LOAD=1")],
)
def test_a_file_cut_rewritten_or_replaced_under_a_mapped_load_is_a_named_error_not_a_sigbus(make_checkpoint, tmp_path, fmt, threads):
    # With HF_DEACTIVATE_ASYNC_LOAD=1 every read is on the calling thread and no thread watches the leases: the end of
    # each mapped window looks at its lease instead.
    source = shutil.copytree(make_checkpoint("llama", fmt), tmp_path / "source")
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    cases = [f"{how}-{where}" for how in ("truncate", "rewrite", "rename") for where in ("start", "middle", "end")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if threads != "reader threads":
        cases = ["truncate-middle", "rewrite-end", "rename-start"]
        env["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    proc = subprocess.run(
        [sys.executable, str(script), str(source), str(tmp_path), *cases], capture_output=True, text=True, timeout=600,
        env=env, cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    lines = [line for line in proc.stdout.splitlines() if line.split(" ")[0] in cases]
    assert proc.returncode == 0, (proc.returncode, lines, proc.stderr[-3000:])  # -7: SIGBUS
    assert [line.split(" ")[0] for line in lines] == cases, (lines, proc.stderr[-3000:])
    for line in lines:
        case, windows, at, waited, outcome = line.split(" ", 4)
        how = case.split("-")[0]
        assert int(windows.split("=")[1]) >= 3, line  # start, middle and end are different windows
        assert outcome.startswith("NAMED ") and ("changed while it loaded" in outcome or "the file ended" in outcome), line
        # the writer finished this long after the window it damaged was done with: it waited for the lease (>= 0),
        # which was given up at once, not after the kernel's 45 s break time
        seconds = float(waited.split("=")[1])
        if how != "rename":
            assert 0 <= seconds < 5, line
