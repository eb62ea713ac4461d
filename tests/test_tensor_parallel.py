"""Tensor-parallel loading in real gloo process groups: each rank reads only its slices and gets the model
transformers' own ``tp_plan="auto"`` builds."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import lowmem_hf

ARCHS = {
    # 8 heads / 4 kv heads: divisible by 2 and 4 ranks
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2_tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, tie_word_embeddings=False)),
}


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    paths = {}
    for name, build in ARCHS.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name, max_shard_size="1MB")
        paths[name] = str(root / name)
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _worker(rank: int, world: int, port: int, paths: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, path in paths.items():
            ids = (torch.arange(16).reshape(2, 8) * 5 + 1) % 256
            single = transformers.AutoModelForCausalLM.from_pretrained(path)
            with torch.no_grad():
                expected = single(ids).logits
            theirs = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto")

            # a first load pays lazy imports (module files count in rchar); measure the second
            lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, tp_plan="auto")
            # rchar also counts socket reads: fence the load so no gloo traffic of other ranks lands inside it
            dist.barrier()
            before = _rchar()
            ours, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, tp_plan="auto", output_loading_info=True)
            read_by_syscalls = _rchar() - before
            dist.barrier()

            # the same sharded model: DTensors with transformers' placements, bit-identical local shards
            for (n, p_ours), (_, p_theirs) in zip(ours.named_parameters(), theirs.named_parameters()):
                assert type(p_ours.data) is type(p_theirs.data), n
                if hasattr(p_theirs.data, "placements"):
                    assert p_ours.data.placements == p_theirs.data.placements, n
                    assert torch.equal(p_ours.data.to_local(), p_theirs.data.to_local()), n
                else:
                    assert torch.equal(p_ours.data, p_theirs.data), n
            for attr in ("_tp_size", "tp_size", "is_distributed_loading_by_transformers", "_tp_plan"):
                assert getattr(ours, attr) == getattr(theirs, attr), attr
            assert ours.config.distributed_config.to_dict() == theirs.config.distributed_config.to_dict(), (ours.config.distributed_config.to_dict(), theirs.config.distributed_config.to_dict())
            assert ours._device_mesh.size() == world
            with torch.no_grad():
                logits = ours(ids).logits
            max_diff = (logits - expected).abs().max().item()

            # bytes: this rank's slices + replicated tensors (+ headers), nothing else
            local_bytes = sum(
                (p.data.to_local() if hasattr(p.data, "to_local") else p.data).numel() * 4
                for n, p in ours.named_parameters() if n in report.dtype_decisions
            )
            results[name] = {
                "max_diff": max_diff,
                "tensor_bytes_read": report.bytes_read - report.header_bytes,
                "local_bytes": local_bytes,
                "rchar": read_by_syscalls,
                "gap_bytes": report.gap_bytes,
                "header_bytes": report.header_bytes,
                "checkpoint_bytes": sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors")),
            }
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        try:
            lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(paths["llama"], device_mesh=mesh, tp_size=world * 2)
        except ValueError as e:
            results["mesh_error"] = str(e)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_read_only_their_slices_and_match_transformers(tp_checkpoints, tmp_path, world):
    mp.spawn(_worker, args=(world, _free_port(), tp_checkpoints, str(tmp_path)), nprocs=world, join=True)
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results.pop("mesh_error") == f"device_mesh has {world} ranks but tp_size={world * 2}; pass one or make them agree."
        assert set(results) == set(ARCHS)
        for name, r in results.items():
            assert r["max_diff"] < 1e-4, (name, rank, r)
            assert r["tensor_bytes_read"] == r["local_bytes"], (name, rank, r)
            # every read syscall: the slices, the headers and indexes, config/generation json (a few KiB); rank 0
            # also hosts the TCPStore that the device-mesh set-up inside from_pretrained talks to (socket reads)
            # and, the files being in the page cache, the bytes between the runs of row-wise slices (one read
            # per band of rows instead of one per row), never more than the other ranks' part of those rows
            slack = 64 * 1024 + (128 * 1024 if rank == 0 else 0)
            assert r["gap_bytes"] <= r["checkpoint_bytes"] - r["local_bytes"], (name, rank, r)
            assert r["local_bytes"] <= r["rchar"] <= r["local_bytes"] + r["header_bytes"] + r["gap_bytes"] + slack, (name, rank, r)
            assert r["tensor_bytes_read"] < r["checkpoint_bytes"] / world * 1.05, (name, rank, r)


def test_local_mode_loads_one_ranks_slices_without_a_group(tp_checkpoints):
    path = tp_checkpoints["llama"]
    full = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path).state_dict()
    model, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, tp_rank=1, tp_size=2, output_loading_info=True)
    assert report.shards["model.layers.0.self_attn.o_proj.weight"].dim == 1
    assert report.shards["model.layers.0.self_attn.q_proj.weight"].dim == 0
    assert "model.norm.weight" not in report.shards
    for name, t in model.state_dict().items():
        spec = report.shards.get(name)
        expected = full[name].narrow(spec.dim, spec.start, spec.stop - spec.start) if spec else full[name]
        assert torch.equal(t, expected), name
    assert any("NOT tensor-parallel" in n for n in report.notes)


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"tp_rank": 2, "tp_size": 2}, ValueError, r"tp_rank=2 is not a rank of tp_size=2"),
        ({"tp_rank": 0, "tp_size": 3}, ValueError, r"model.embed_tokens.weight has 256 along dimension 0 \(shape \[256, 256\], style .embedding_rowwise.\), which tp_size=3 does not divide"),
        ({"tp_plan": "auto"}, ValueError, r"needs either an initialized process group"),
        ({"tp_plan": {"model.layers.*.mlp.up_proj": "packed_colwise"}, "tp_rank": 0, "tp_size": 2}, NotImplementedError, r"'packed_colwise' on model.layers.0.mlp.up_proj"),
    ],
)
def test_bad_tp_requests_fail_before_reading(tp_checkpoints, kwargs, error, message):
    with pytest.raises(error, match=message):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(tp_checkpoints["llama"], **kwargs)


def test_heads_that_do_not_divide_are_refused_up_front(tmp_path):
    # 9 heads of 8: q_proj has 72 rows, which 2 divides; the heads do not (transformers fails later, in forward)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=72, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=9, num_key_value_heads=9, head_dim=8)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"q_proj.weight is sharded by attention head, but num_attention_heads=9"):
        lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(tmp_path, tp_rank=0, tp_size=2)


@pytest.mark.parametrize("fmt", ["bin", "sharded"])
def test_local_mode_slices_bin_and_safetensors_alike(make_checkpoint, fmt):
    path = make_checkpoint("llama", fmt)  # 4 heads, 2 kv heads: tp_size 2
    full = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).state_dict()
    for rank in range(2):
        model, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
            path, torch_dtype=torch.bfloat16, tp_rank=rank, tp_size=2, output_loading_info=True
        )
        for name, t in model.state_dict().items():
            spec = report.shards.get(name)
            expected = full[name].narrow(spec.dim, spec.start, spec.stop - spec.start) if spec else full[name]
            assert torch.equal(t, expected), (name, rank)


def test_tp_over_a_single_rank_is_a_plain_load(tp_checkpoints, monkeypatch):
    # torchrun --nproc-per-node 1: transformers builds no mesh; the model is loaded whole, not sharded
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    path = tp_checkpoints["llama"]
    model, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, tp_plan="auto", output_loading_info=True)
    assert report.shards == {} and not dist.is_initialized()
    plain = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path)
    for name, t in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
