"""One rank of a TP x FSDP2 x HSDP mesh, planned and loaded with no process group (``device_mesh=MeshRank(...)``).

Each rank's shards must be bit-identical to the local shards transformers' own
``from_pretrained(distributed_config=...)`` gives that rank in a real gloo group (one spawn of 4 ranks runs every
mesh); the planner must say the same bytes for it, and the arithmetic must reject ranks outside the mesh.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers.distributed import DistributedConfig

import lowmem_hf
from lowmem_hf.distributed.mesh_rank import MeshRank
from lowmem_hf.load import prepare
from lowmem_hf.request import make_request

_SMALL = dict(hidden_size=128, intermediate_size=320, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=256, tie_word_embeddings=False, **_SMALL)),
    # FSDP2 shards unevenly (torch.chunk) where a dim does not divide: 257 rows over 4 ranks
    "llama_uneven": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=257, tie_word_embeddings=False, **_SMALL)),
    "qwen2_tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=256, tie_word_embeddings=True, **_SMALL)),
    "starcoder2": lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(vocab_size=256, use_bias=True, **_SMALL)),
}
MESHES = {"tp2xfsdp2": dict(tp_size=2, fsdp_size=2), "hsdp2x2": dict(dp_replicate_size=2, fsdp_size=2), "fsdp4": dict(fsdp_size=4)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh_rank")
    paths = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name, max_shard_size="200KB")
        paths[name] = str(root / name)
    return paths


def test_a_mesh_rank_s_coordinate_varies_tp_fastest_as_transformers_lays_the_mesh():
    mesh = MeshRank(rank=13, tp_size=4, fsdp_size=2, dp_replicate_size=2)
    assert mesh.world_size == 16 and mesh.coordinate == (1, 1, 1) and mesh.tp_rank == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(rank=4, tp_size=2, fsdp_size=2), "MeshRank(rank=4) is not a rank of a 1 x 2 x 2 mesh; ranks are 0..3."),
    (dict(rank=0, tp_size=0), "MeshRank.tp_size must be an int >= 1, got 0."),
    (dict(rank=-1), "MeshRank.rank must be an int >= 0, got -1."),
])
def test_a_rank_outside_the_mesh_is_refused_with_the_mesh_in_the_message(kwargs, message):
    with pytest.raises(ValueError) as info:
        MeshRank(**kwargs)
    assert str(info.value) == message


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _transformers_rank(rank: int, world: int, port: int, paths: dict, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mesh, sizes in MESHES.items():
            for family, path in paths.items():
                model = transformers.AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(**sizes))
                local = {n: (p.data.to_local() if hasattr(p.data, "to_local") else p.data).clone() for n, p in model.named_parameters()}
                torch.save(local, os.path.join(out_dir, f"{mesh}-{family}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_mesh_rank_loaded_alone_holds_what_transformers_gives_it_in_a_group(checkpoints, tmp_path):
    mp.spawn(_transformers_rank, args=(4, _free_port(), checkpoints, str(tmp_path)), nprocs=4, join=True)
    problems = []
    for mesh, sizes in MESHES.items():
        for family, path in checkpoints.items():
            if family == "llama_uneven" and "tp_size" in sizes:  # TP's forward needs equal shards: refused, as with a group
                with pytest.raises(ValueError, match="which tp_size=2 does not divide"):
                    lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, device_mesh=MeshRank(rank=0, **sizes))
                continue
            for rank in range(4):
                theirs = torch.load(tmp_path / f"{mesh}-{family}-{rank}.pt")
                model = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(path, device_mesh=MeshRank(rank=rank, **sizes))
                ours = dict(model.named_parameters())
                problems += [f"{mesh} {family} rank {rank}: {n} missing" for n in theirs if n not in ours]
                problems += [
                    f"{mesh} {family} rank {rank}: {n} {tuple(ours[n].shape)} vs {tuple(t.shape)}"
                    for n, t in theirs.items() if n in ours and not torch.equal(ours[n].data, t)
                ]
                assert any("mesh" in note for note in model.lowmem_report.notes)
    assert not problems, problems[:10]


def test_the_dry_run_of_a_mesh_rank_reads_exactly_its_shards(checkpoints):
    path = checkpoints["llama"]
    full = prepare(make_request(transformers.AutoModelForCausalLM, path)).estimate()
    shares = [
        prepare(make_request(transformers.AutoModelForCausalLM, path, device_mesh=MeshRank(rank=r, tp_size=2, fsdp_size=2))).estimate()
        for r in range(4)
    ]
    assert [s.rank for s in shares] == [0, 1, 2, 3]
    # each rank reads what it holds, plus the same headers, less the rotary buffer every rank computes whole
    assert {s.bytes_to_read - s.final_bytes for s in shares} == {full.bytes_to_read - full.final_bytes}
    # the ranks together hold the model once, but for the norms both TP ranks hold and the buffers
    assert full.final_bytes < sum(s.final_bytes for s in shares) < 1.01 * full.final_bytes


def test_lowmem_hf_plan_prints_every_rank_of_a_mesh_without_a_group(checkpoints, capsys):
    from lowmem_hf import cli

    assert cli.main(["plan", checkpoints["llama"], "--tp-size", "2", "--fsdp-size", "2", "--json"]) == 0
    import json

    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert cli.main(["plan", checkpoints["llama"], "--tp-size", "2", "--fsdp-size", "2", "--rank", "4"]) == 2
    assert "--rank 4 is not a rank of a world of 4; ranks are 0..3" in capsys.readouterr().err


@pytest.mark.parametrize("size, split_factor, num_chunks", [(53248, 8, 8), (257, 2, 4), (10, 4, 3), (3, 4, 8), (1, 1, 2)])
def test_strided_shard_runs_are_the_indices_torch_s_cut_gives(size, split_factor, num_chunks):
    from lowmem_hf.distributed.mesh import strided_shard_indices, strided_shard_positions

    for rank in range(num_chunks):
        runs = strided_shard_positions(size, split_factor, num_chunks, rank)
        assert [i for a, b in runs for i in range(a, b)] == strided_shard_indices(size, split_factor, num_chunks, rank)
