"""Crash-safe saves: a save into a folder that holds a checkpoint leaves it loadable until the new one is complete
(written aside, switched at the end), a failed save leaves no partial file and names the file and the bytes it
needs, a kill at any moment leaves a folder that loads one checkpoint whole, and every rank agrees.

Full disks are real: a tmpfs of a few MiB (root only; skipped otherwise) or RLIMIT_FSIZE in a child process."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import lowmem_hf

PAGE = 4096
LAYOUTS = {  # how each test checkpoint is saved
    "one file": dict(),
    "4 shards": dict(max_shard_size="100KB"),
    "2 shards": dict(max_shard_size="200KB"),
    "rank files": dict(distributed_checkpoint=True),
}


def _model(seed: int) -> transformers.LlamaForCausalLM:
    """A tiny untied Llama (~360 KB in fp32); different seeds give different weights of the same shapes."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=64,
    ))


def _loads_as(path, model, *, transformers_too: bool = True) -> None:
    """``path`` loads, with lowmem_hf and transformers, into exactly ``model``'s tensors."""
    loaders = [lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained]
    if transformers_too:
        loaders.append(transformers.AutoModelForCausalLM.from_pretrained)
    expected = model.state_dict()
    for loader in loaders:
        state = loader(path).state_dict()
        assert state.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(state[name], tensor), (loader, name)


def _listing(path) -> dict[str, int]:
    """Every file under ``path`` (recursively) with its size."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = os.path.getsize(full)
    return out


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs of its own, so that a full disk is a real ENOSPC; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def _free(disk) -> int:
    stat = os.statvfs(disk)
    return stat.f_bavail * stat.f_frsize


def _leave_free(disk, nbytes: int) -> None:
    """Fill ``disk`` with a file until exactly ``nbytes`` (a multiple of the page size) are free."""
    fd = os.open(os.path.join(disk, "filler"), os.O_CREAT | os.O_WRONLY)
    try:
        os.posix_fallocate(fd, 0, _free(disk) - nbytes)
    finally:
        os.close(fd)
    assert _free(disk) == nbytes


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@pytest.mark.parametrize("layout", ["one file", "4 shards"])
def test_a_full_disk_names_the_file_and_the_bytes_and_keeps_the_old_checkpoint(small_disk, layout):
    out = small_disk / "out"
    old, new = _model(0), _model(1)
    lowmem_hf.save_pretrained(old, out, **LAYOUTS[layout])
    before = _listing(out)
    first = "model.safetensors" if layout == "one file" else "model-00001-of-00004.safetensors"
    _leave_free(small_disk, 0)

    with pytest.raises(OSError) as e:
        lowmem_hf.save_pretrained(new, out, **LAYOUTS[layout])
    assert e.value.errno == errno.ENOSPC
    message = str(e.value)
    assert f"writing {out / first}: No space left on device. The file needs {before[first]} bytes" in message
    needed = sum(size for name, size in before.items() if name.endswith(".safetensors"))
    assert f"the new checkpoint's weights need {needed} bytes in all" in message
    assert f"the device had 0 bytes free when the save began, {needed} bytes short" in message
    assert f"nothing in {out} changed" in message
    assert _listing(out) == before  # no partial file, nothing of the old checkpoint touched
    _loads_as(out, old)


@pytest.mark.parametrize("fails_on", ["the last shard", "generation_config.json"])
def test_a_disk_that_fills_during_a_re_save_keeps_the_old_checkpoint(small_disk, fails_on):
    """The new files need room next to the old ones; the disk runs out part way, on a shard or on a config file."""
    out = small_disk / "out"
    old, new = _model(0), _model(1)
    lowmem_hf.save_pretrained(old, out, **LAYOUTS["4 shards"])
    before = _listing(out)
    shards = sorted(n for n in before if n.startswith("model-"))
    # the new files have the sizes of the old ones (same shapes); tmpfs counts whole pages
    room = sum(_pages(before[n]) for n in shards)
    if fails_on == "the last shard":
        room -= PAGE
        failing = shards[-1]
    else:
        room += _pages(before["model.safetensors.index.json"]) + _pages(before["config.json"])
        failing = "generation_config.json"
    _leave_free(small_disk, room)

    with pytest.raises(OSError) as e:
        lowmem_hf.save_pretrained(new, out, **LAYOUTS["4 shards"])
    assert e.value.errno == errno.ENOSPC
    assert f"writing {out / failing}: No space left on device" in str(e.value)
    if failing in shards:
        assert f"The file needs {before[failing]} bytes" in str(e.value)
    assert _listing(out) == before
    _loads_as(out, old)
    os.remove(small_disk / "filler")
    lowmem_hf.save_pretrained(new, out, **LAYOUTS["4 shards"])  # with room, the same save goes through
    _loads_as(out, new)


def test_a_file_too_large_for_the_process_names_max_shard_size_and_keeps_the_old_checkpoint(tmp_path):
    """RLIMIT_FSIZE makes the one file of the new checkpoint fail (EFBIG) on its last bytes."""
    out = tmp_path / "out"
    old = _model(0)
    lowmem_hf.save_pretrained(old, out, **LAYOUTS["4 shards"])
    before = _listing(out)
    script = textwrap.dedent(f"""
        import resource, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import lowmem_hf
        from test_integrity_save import _model
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            lowmem_hf.save_pretrained(_model(1), {str(out)!r})
        except OSError as e:
            print(e.errno, e)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(f"{errno.EFBIG} "), proc.stdout + proc.stderr[-3000:]
    assert f"writing {out / 'model.safetensors'}: File too large (it needs" in proc.stdout
    assert "Pass a smaller max_shard_size." in proc.stdout
    assert _listing(out) == before
    _loads_as(out, old)


@pytest.mark.parametrize("old_layout, new_layout", [
    ("4 shards", "2 shards"), ("2 shards", "4 shards"), ("4 shards", "4 shards"), ("4 shards", "one file"),
    ("one file", "4 shards"), ("rank files", "4 shards"), ("4 shards", "rank files"), ("one file", "rank files"),
])
def test_a_successful_re_save_replaces_the_old_checkpoint_whole(tmp_path, old_layout, new_layout):
    out, fresh = tmp_path / "out", tmp_path / "fresh"
    old, new = _model(0), _model(1)
    lowmem_hf.save_pretrained(old, out, **LAYOUTS[old_layout])
    lowmem_hf.save_pretrained(new, out, **LAYOUTS[new_layout])
    lowmem_hf.save_pretrained(new, fresh, **LAYOUTS[new_layout])
    assert _listing(out) == _listing(fresh)  # not one file of the old checkpoint left, no staging folder
    for name in _listing(fresh):
        with open(out / name, "rb") as a, open(fresh / name, "rb") as b:
            assert a.read() == b.read(), name
    _loads_as(out, new, transformers_too=new_layout != "rank files")


_KILL_SCRIPT = """
import os, shutil, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import lowmem_hf
from test_integrity_save import LAYOUTS, _model

out, pristine, states = {out!r}, {pristine!r}, {states!r}
new = _model(1)
k = 0
while True:
    k += 1
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(pristine, out)
    pid = os.fork()
    if pid == 0:  # the child dies at the k-th rename, link or removal of the save
        calls = [0]
        def dying(real):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == k:
                    os._exit(3)
                return real(*args, **kwargs)
            return call
        os.replace, os.remove, os.link = dying(os.replace), dying(os.remove), dying(os.link)
        lowmem_hf.save_pretrained(new, out, **LAYOUTS[{layout!r}])
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 3), code
    shutil.copytree(out, os.path.join(states, f"{{k:03d}}-{{'done' if code == 0 else 'killed'}}"))
    if code == 0:
        break
"""


@pytest.mark.parametrize("old_layout, new_layout", [
    ("4 shards", "4 shards"), ("one file", "4 shards"), ("4 shards", "one file"), ("rank files", "rank files"),
])
def test_a_kill_at_any_moment_of_the_switch_leaves_one_whole_checkpoint(tmp_path, old_layout, new_layout):
    """A child process dies at each rename/link/removal of the save in turn: every folder it leaves loads the old
    checkpoint or the new one, whole. The rank-local format has no index to switch: there a kill may leave a folder
    that does not load, never one that mixes the two."""
    pristine, out, states = tmp_path / "pristine", tmp_path / "out", tmp_path / "states"
    old, new = _model(0), _model(1)
    lowmem_hf.save_pretrained(old, pristine, **LAYOUTS[old_layout])
    script = _KILL_SCRIPT.format(tests=os.path.dirname(__file__), out=str(out), pristine=str(pristine), states=str(states), layout=new_layout)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = []
    for state in sorted(os.listdir(states)):
        folder = states / state
        try:
            loaded = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(folder).state_dict()
        except (OSError, ValueError) as e:
            assert new_layout == "rank files" and not state.endswith("done"), (state, os.listdir(folder), e)
            seen.append("none")
            continue
        which = [name for name, model in (("old", old), ("new", new))
                 if all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())]
        assert which, f"{state}: {sorted(os.listdir(folder))} loads neither checkpoint whole"
        if new_layout != "rank files":
            _loads_as(folder, old if which == ["old"] else new)
        seen.append(which[0])
    assert seen[0] == "old" and seen[-1] == "new" and len(seen) > 3, seen
    # the next save into any of these folders leaves exactly what a save into an empty one does
    lowmem_hf.save_pretrained(new, tmp_path / "fresh", **LAYOUTS[new_layout])
    for state in sorted(os.listdir(states)):
        lowmem_hf.save_pretrained(new, states / state, **LAYOUTS[new_layout])
        assert _listing(states / state) == _listing(tmp_path / "fresh"), state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, world: int, port: int, src: str, root: str) -> None:
    """Two TP ranks; one of them cannot write files larger than 100 KB. Every rank raises the same error, and the
    checkpoint already in the folder still loads."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(src, tp_plan="auto")
        for kwargs, failing_rank in ((dict(), 0), (dict(distributed_checkpoint=True), 1)):
            out = os.path.join(root, "rank-files" if kwargs else "gathered")
            lowmem_hf.save_pretrained(model, out, **kwargs)
            dist.barrier()
            before = _listing(out)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(2.0)  # another model to save; halved back exactly below
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            if rank == failing_rank:
                resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limit[1]))
            try:
                with pytest.raises(OSError) as e:
                    lowmem_hf.save_pretrained(model, out, **kwargs)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limit)
            assert e.value.errno == errno.EFBIG
            assert f"rank {failing_rank}: writing {out}" in str(e.value) and "File too large" in str(e.value)
            assert f"rank {1 - failing_rank}:" not in str(e.value)
            dist.barrier()
            assert _listing(out) == before
            with torch.no_grad():
                for p in model.parameters():
                    p.div_(2.0)
            # every rank loads (a load under a process group takes part in collectives)
            _loads_as(out, transformers.AutoModelForCausalLM.from_pretrained(src), transformers_too=not kwargs)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_every_rank_raises_when_one_rank_cannot_write_and_the_old_checkpoint_stays(tmp_path):
    _model(0).save_pretrained(tmp_path / "src")
    mp.spawn(_rank_worker, args=(2, _free_port(), str(tmp_path / "src"), str(tmp_path)), nprocs=2, join=True)
