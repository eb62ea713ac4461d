"""Resume from sharded training checkpoints and save back, in real gloo process groups: DCP and transformers'
sharded format load per rank at any tp_size; lowmem_hf.save_pretrained writes what transformers writes."""

import glob
import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import transformers
from safetensors.torch import load_file

import lowmem_hf
from lowmem_hf.runs import box_runs, overlap

ARCHS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2_tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=True)),
}
IDS = (torch.arange(16).reshape(2, 8) * 5 + 1) % 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files_state(directory: str) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(glob.glob(os.path.join(directory, "*.safetensors"))) for k, v in load_file(f).items()}


def _assert_same_model(ours, reference, what: str) -> None:
    """Same parameters and buffers (local shards of DTensors), tied weights tied, nothing on meta."""
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, p in ours.named_parameters(remove_duplicate=False):
        r = ref_params[name]
        if hasattr(r.data, "placements"):
            assert p.data.placements == r.data.placements, (what, name)
            assert torch.equal(p.data.to_local(), r.data.to_local()), (what, name)
        else:
            assert torch.equal(p.data, r.data), (what, name)
    ref_buffers = dict(reference.named_buffers())
    for name, b in ours.named_buffers():
        assert b.device.type != "meta" and torch.equal(b, ref_buffers[name]), (what, name)
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight, what


def _worker(rank: int, world: int, port: int, paths: dict, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    load = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained
    try:
        for name, path in paths.items():
            out = lambda kind: os.path.join(root, f"{name}-{kind}")  # noqa: E731
            ours = load(path, tp_plan="auto")
            single = transformers.AutoModelForCausalLM.from_pretrained(path)

            # 1. dcp.save of the TP state dict -> lowmem at tp 2 (same shards) and at tp 1 (whole tensors)
            dcp.save(ours.state_dict(), checkpoint_id=out("dcp"))
            if rank == 0:
                ours.config.save_pretrained(out("dcp"))
            dist.barrier()
            _assert_same_model(load(out("dcp"), tp_plan="auto"), ours, "dcp tp2")
            resumed, report = load(out("dcp"), output_loading_info=True)
            assert report.checkpoint_format == "dcp" and not report.missing_keys
            _assert_same_model(resumed, single, "dcp tp1")

            # 2. lowmem's own sharded save (tied models too) -> lowmem at tp 2 and tp 1
            lowmem_hf.save_pretrained(ours, out("lowmem-sharded"), distributed_checkpoint=True)
            _assert_same_model(load(out("lowmem-sharded"), tp_plan="auto"), ours, "lowmem sharded tp2")
            _assert_same_model(load(out("lowmem-sharded")), single, "lowmem sharded tp1")

            # 3. gathered save -> one process loads it with transformers: logits of the TP model, same tensors as
            #    transformers' own save_pretrained of the same model
            with torch.no_grad():
                tp_logits = ours(IDS).logits
            lowmem_hf.save_pretrained(ours, out("saved"), max_shard_size="100KB")
            theirs = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
            theirs.save_pretrained(out("transformers-tp-saved"), max_shard_size="100KB")
            if rank == 0:
                single.save_pretrained(out("transformers-saved"), max_shard_size="100KB")
                reloaded = transformers.AutoModelForCausalLM.from_pretrained(out("saved"))
                with torch.no_grad():
                    torch.testing.assert_close(reloaded(IDS).logits, tp_logits, atol=1e-5, rtol=0)
                written, expected = _files_state(out("saved")), _files_state(out("transformers-saved"))
                assert written.keys() == expected.keys()
                assert all(torch.equal(written[k], expected[k]) for k in expected)
                assert sorted(os.listdir(out("saved"))) == sorted(os.listdir(out("transformers-saved")))
                index = lambda d: json.load(open(os.path.join(out(d), "model.safetensors.index.json")))  # noqa: E731
                assert index("saved") == index("transformers-saved")
                # transformers' own TP save gathers tied weights into two tensors and writes both names
                # (lm_head.weight too); every tensor lowmem_hf writes equals the one it writes under that name
                tp_written = _files_state(out("transformers-tp-saved"))
                assert all(torch.equal(written[k], tp_written[k]) for k in written)
            dist.barrier()

            if name == "llama":
                # 4. transformers' distributed_checkpoint directories -> lowmem at tp 2 and tp 1; and transformers
                #    loads lowmem's sharded save of an untied model
                theirs.save_pretrained(out("transformers-sharded"), distributed_checkpoint=True)
                _assert_same_model(load(out("transformers-sharded"), tp_plan="auto"), ours, "transformers sharded tp2")
                _assert_same_model(load(out("transformers-sharded")), single, "transformers sharded tp1")
                back = transformers.AutoModelForCausalLM.from_pretrained(out("lowmem-sharded"), tp_plan="auto")
                _assert_same_model(back, ours, "transformers loads lowmem sharded")

                # 5. an FSDP2 run's dcp.save (dim-0 chunks of every tensor, including norms) -> lowmem at tp 2 and 1
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                fsdp = transformers.AutoModelForCausalLM.from_pretrained(path)
                mesh = init_device_mesh("cpu", (world,))
                for layer in fsdp.model.layers:
                    fully_shard(layer, mesh=mesh)
                fully_shard(fsdp, mesh=mesh)
                dcp.save(fsdp.state_dict(), checkpoint_id=out("fsdp"))
                if rank == 0:
                    fsdp.config.save_pretrained(out("fsdp"))
                dist.barrier()
                _assert_same_model(load(out("fsdp"), tp_plan="auto"), ours, "fsdp2 dcp tp2")
                _assert_same_model(load(out("fsdp")), single, "fsdp2 dcp tp1")

                # 6. a directory no rank can write fails on every rank before anything is written
                blocked = os.path.join(root, "a-file")
                open(blocked, "w").close()
                with pytest.raises(OSError, match="a-file"):
                    lowmem_hf.save_pretrained(ours, os.path.join(blocked, "out"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_run(tmp_path_factory):
    """Run the 2-rank round trips once; the single-process tests below reuse the directories they wrote."""
    root = tmp_path_factory.mktemp("resume")
    paths = {}
    for name, build in ARCHS.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name)
        paths[name] = str(root / name)
    mp.spawn(_worker, args=(2, _free_port(), paths, str(root)), nprocs=2, join=True)
    return root


def test_round_trips_at_two_ranks(distributed_run):
    assert (distributed_run / "llama-saved" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize("kind", ["dcp", "transformers-sharded", "lowmem-sharded"])
def test_tp_checkpoint_loads_one_rank_slice_without_a_group(distributed_run, kind):
    """Local mode: tp_rank/tp_size and no process group, reading only the overlap of the two ranks' chunks."""
    full = transformers.AutoModelForCausalLM.from_pretrained(distributed_run / "llama")
    full_state = full.state_dict()
    for tp_size in (2, 4):
        model, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
            distributed_run / f"llama-{kind}", tp_plan="auto", tp_size=tp_size, tp_rank=1, output_loading_info=True
        )
        state = model.state_dict()
        for name, spec in report.shards.items():
            assert torch.equal(state[name], full_state[name].narrow(spec.dim, spec.start, spec.stop - spec.start)), name
        assert report.bytes_read < 1.1 * report.model_bytes + 64 * 1024


def test_overlap_and_runs_of_a_dim1_chunk():
    # a [4, 6] tensor stored as two column chunks [4, 3]; rank wants rows 1..3 of everything
    assert overlap((0, 3), (4, 3), (1, 0), (3, 6)) == ((1, 3), (3, 6))
    assert overlap((0, 0), (2, 6), (2, 0), (4, 6)) is None
    runs = box_runs((4, 3), (1, 0), (2, 6), (0, 3), (2, 3))
    assert runs == [(3, 3, 3), (6, 9, 3)]
    # a whole chunk into the matching rows of the destination: one run
    assert box_runs((2, 6), (0, 0), (4, 6), (2, 0), (2, 6)) == [(0, 12, 12)]


@pytest.fixture
def llama_dcp(tmp_path):
    torch.manual_seed(0)
    model = ARCHS["llama"]()
    model.config.save_pretrained(tmp_path)
    return model, tmp_path


def test_missing_key_is_named(llama_dcp):
    model, path = llama_dcp
    state = model.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    dcp.save(state, checkpoint_id=path, no_dist=True)
    with pytest.raises(lowmem_hf.MissingKeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)


def test_global_shape_mismatch_names_both_shapes(llama_dcp):
    model, path = llama_dcp
    dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    with pytest.raises(lowmem_hf.ShapeMismatchError, match=r"checkpoint \[256, 128\].*model \[512, 128\]"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, vocab_size=512)


def test_truncated_distcp_names_the_file(llama_dcp):
    model, path = llama_dcp
    dcp.save(model.state_dict(), checkpoint_id=path, no_dist=True)
    (distcp,) = glob.glob(str(path / "*.distcp"))
    os.truncate(distcp, os.path.getsize(distcp) // 2)
    with pytest.raises(lowmem_hf.CorruptCheckpointError, match=os.path.basename(distcp) + ".*truncated"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)


def test_truncated_shard_names_the_file(llama_dcp, tmp_path):
    model, _ = llama_dcp
    out = tmp_path / "sharded"
    lowmem_hf.save_pretrained(model, out, distributed_checkpoint=True)
    (shard,) = glob.glob(str(out / "shard-*.safetensors"))
    os.truncate(shard, os.path.getsize(shard) - 100)
    with pytest.raises(lowmem_hf.CorruptCheckpointError, match=os.path.basename(shard) + ".*truncated"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(out)


def test_checkpoint_format_dcp_is_explicit_where_detection_cannot_tell(llama_dcp, tmp_path):
    model, _ = llama_dcp
    with pytest.raises(lowmem_hf.CheckpointNotFoundError, match="not a sharded training checkpoint"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(llama_dcp[1], checkpoint_format="dcp")
    with pytest.raises(ValueError, match="checkpoint_format='zip'"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(llama_dcp[1], checkpoint_format="zip")


def test_unwritable_directory_fails_before_writing(llama_dcp, tmp_path):
    model, _ = llama_dcp
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    with pytest.raises(OSError, match="blocked"):
        lowmem_hf.save_pretrained(model, blocked / "out")
    if os.geteuid() != 0:  # root writes anywhere
        readonly = tmp_path / "readonly"
        readonly.mkdir(mode=0o555)
        with pytest.raises(OSError, match="not writable"):
            lowmem_hf.save_pretrained(model, readonly)
        assert not os.listdir(readonly)


def test_local_slices_refuse_to_save_as_full_tensors(tmp_path):
    torch.manual_seed(0)
    ARCHS["llama"]().save_pretrained(tmp_path / "src")
    part = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(tmp_path / "src", tp_plan="auto", tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight has shape \[128, 128\].*\[256, 128\].*tp_rank"):
        lowmem_hf.save_pretrained(part, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_save_killed_halfway_leaves_no_index(tmp_path):
    torch.manual_seed(0)
    ARCHS["llama"]().save_pretrained(tmp_path / "src")
    script = textwrap.dedent(f"""
        import os, lowmem_hf, lowmem_hf.save.gathered as save
        model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained({str(tmp_path / 'src')!r})
        written = []
        real = save._pwrite_runs
        def dying(*args):  # the process dies mid-save, after a few tensors
            written.append(1)
            if len(written) == 6:
                os._exit(3)
            real(*args)
        save._pwrite_runs = dying
        lowmem_hf.save_pretrained(model, {str(tmp_path / 'out')!r}, max_shard_size="100KB")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    names = os.listdir(tmp_path / "out")
    assert "model.safetensors.index.json" not in names and "config.json" not in names
    assert names and all(n.endswith(".partial") for n in names)
    # a later complete save cleans up and looks complete
    model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(tmp_path / "src")
    lowmem_hf.save_pretrained(model, tmp_path / "out", max_shard_size="100KB")
    assert json.load(open(tmp_path / "out" / "model.safetensors.index.json"))["weight_map"]


def test_resume_example_trains_saves_resumes_at_another_tp_size_and_reloads(distributed_run, tmp_path):
    """examples/finetune_tp_resume.py: 2 TP ranks save a sharded checkpoint mid-run, one process resumes it and
    saves the Hub layout, which transformers loads with no missing or unexpected key."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = os.path.join(repo, "examples", "finetune_tp_resume.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p))
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    runs = [
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
         example, "--model", str(distributed_run / "qwen2_tied"), "--checkpoint", ckpt, "--steps", "3", "--save-at", "2"],
        [sys.executable, example, "--model", ckpt, "--steps", "2", "--output-dir", out],
    ]
    for argv in runs:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "step 2: loss" in proc.stdout
    assert glob.glob(os.path.join(ckpt, "shard-*-model-*.safetensors"))
    original = transformers.AutoModelForCausalLM.from_pretrained(distributed_run / "qwen2_tied")
    final, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert final.lm_head.weight is final.model.embed_tokens.weight
    assert not torch.equal(final.model.embed_tokens.weight, original.model.embed_tokens.weight)  # it trained
    assert torch.isfinite(final(IDS).logits).all()
