"""A local checkpoint file truncated, rewritten or replaced by another process while it loads is a named error, never a
crash (SIGBUS) or a silent mix of two files: reads past the new end say the file ended, and after a file's last read
its descriptor and its path must still name the file that was opened, with the size and modification time it had.
"""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

# A child loads a private copy of the checkpoint. At the first, middle or last read of the file read most often,
# another process damages the file and finishes before that read runs, so the rest of the load meets the damaged file.
_CHILD = textwrap.dedent(r"""
    import os, shutil, subprocess, sys, threading, torch
    from lowmem_hf import CorruptCheckpointError
    from lowmem_hf.auto import AUTO_CLASSES
    from lowmem_hf.sources.local import LocalFiles

    source, work, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
    Causal = AUTO_CLASSES["LowMemAutoModelForCausalLM"]
    reads, state, lock = {}, {}, threading.Lock()
    DAMAGE = {
        "truncate": "os.truncate(path, 4096)",
        "rewrite": "f = open(path, 'r+b'); f.seek(0, 2); n = f.tell(); f.seek(n // 2); f.write(os.urandom(n - n // 2)); f.close()",
        "rename": "shutil.copy(path, path + '.new'); os.replace(path + '.new', path)",
    }

    def counted(original):
        def read(self, file, *args):
            with lock:
                i = reads[file] = reads.get(file, 0) + 1
                if file == state.get("target") and i == state["at"]:
                    code = f"import os, shutil; path = {file!r}; {DAMAGE[state['how']]}"
                    subprocess.run([sys.executable, "-c", code], check=True)
            return original(self, file, *args)
        return read

    LocalFiles.read = counted(LocalFiles.read)
    LocalFiles.read_runs = counted(LocalFiles.read_runs)
    clean = Causal.from_pretrained(source, torch_dtype=torch.bfloat16)
    counts = {os.path.basename(f): n for f, n in reads.items() if f.endswith((".safetensors", ".bin"))}
    target = max(counts, key=counts.get)
    for case in cases:
        how, where = case.split("-")
        folder = os.path.join(work, case)
        shutil.copytree(source, folder)
        reads.clear()
        state.update(target=os.path.join(folder, target), how=how, at={"start": 1, "middle": counts[target] // 2, "end": counts[target]}[where])
        try:
            got = Causal.from_pretrained(folder, torch_dtype=torch.bfloat16)
            same = all(torch.equal(got.state_dict()[k], v) for k, v in clean.state_dict().items())
            outcome = f"LOADED same={same}"
        except CorruptCheckpointError as e:
            outcome = "NAMED " + str(e).replace("\n", " ")
        print(case, f"reads={counts[target]}", outcome, flush=True)
""")


@pytest.mark.parametrize(
    "fmt,threads",
    [("sharded", "reader threads"), ("bin", "reader threads"), ("sharded", "HF_DEACTIVATE_ASYNC_LOAD=1")],
)
def test_a_file_cut_rewritten_or_replaced_mid_load_is_a_named_error_not_a_crash(make_checkpoint, tmp_path, fmt, threads):
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
        case, reads, outcome = line.split(" ", 2)
        assert int(reads.split("=")[1]) >= 3, line  # start, middle and end are different reads
        assert outcome.startswith("NAMED ") and ("changed while it loaded" in outcome or "the file ended" in outcome), line


@pytest.mark.parametrize("fmt", ["sharded", "bin"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_file_another_process_holds_open_for_writing_loads_bit_identically(make_checkpoint, tmp_path, fmt, dtype):
    # A writer that has the files open (and writes nothing) changes nothing for the reads: no lease is needed
    # (reads are preadv, never a mapping a cut could kill), so nothing waits on it or falls back, and the model is transformers' bit for bit.
    import torch
    import transformers

    from lowmem_hf.auto import AUTO_CLASSES

    folder = shutil.copytree(make_checkpoint("llama", fmt), tmp_path / "held")
    weights = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith((".safetensors", ".bin"))]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; files = [open(p, 'r+b') for p in sys.argv[1:]]; print('open', flush=True); sys.stdin.read()", *weights],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "open"
        got = AUTO_CLASSES["LowMemAutoModelForCausalLM"].from_pretrained(folder, torch_dtype=getattr(torch, dtype))
    finally:
        holder.communicate("", timeout=60)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    expected, loaded = ref.state_dict(), got.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
