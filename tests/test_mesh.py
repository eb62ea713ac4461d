"""transformers' DistributedConfig meshes in real gloo process groups: FSDP2 (2 ranks), HSDP 2x2 and TP2 x FSDP2.

Every rank's local shards must be bit-identical to transformers' own ``from_pretrained(distributed_config=...)``
with equal placements, the fp32 logits within 1e-4 of one process, and each rank must read only its own bytes.
Spawning process groups dominates the cost, so one spawn per world size runs every mesh and model family, the
Trainer run and the bad-input checks.
"""

import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from transformers.distributed import DistributedConfig

import lowmem_hf
from lowmem_hf.distributed import local_intervals, strided_shard_indices
from lowmem_hf.runs import interval_runs, slice_tensor
from lowmem_hf.types import ShardSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Big enough (~4.6 MB fp32) that the few KiB a load reads besides tensor bytes (config.json, /proc/self/status,
# the rendezvous store) stay within the 2% I/O margin of the smallest local shard (TP2 x FSDP2: 1/4 of it).
_SMALL = dict(hidden_size=128, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=1024, tie_word_embeddings=False, **_SMALL)),
    "qwen2_tied": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=1024, tie_word_embeddings=True, **_SMALL)),
    # biases on every projection and LayerNorm
    "starcoder2": lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(vocab_size=1024, use_bias=True, **_SMALL)),
}
# FSDP2 shards unevenly (torch.chunk) where a dimension does not divide: the last rank holds one row less.
UNEVEN = lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=1025, tie_word_embeddings=False, **_SMALL))
MESHES = {2: {"fsdp2": dict(fsdp_size=2)}, 4: {"hsdp2x2": dict(dp_replicate_size=2, fsdp_size=2), "tp2xfsdp2": dict(tp_size=2, fsdp_size=2)}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    paths = {}
    for name, build in {**FAMILIES, "llama_uneven": UNEVEN}.items():
        torch.manual_seed(0)
        build().save_pretrained(root / name, max_shard_size="1MB")
        paths[name] = str(root / name)
    return paths


# -- the slice rule, as pure functions ------------------------------------------------------------------------


def _all_coordinates(mesh_shape):
    coords = [[]]
    for n in mesh_shape:
        coords = [c + [i] for c in coords for i in range(n)]
    return coords


@pytest.mark.parametrize(
    "shape,mesh_shape,placements",
    [
        ((8, 6), (2,), (Shard(0),)),
        ((9, 6), (2,), (Shard(0),)),  # uneven, FSDP2's torch.chunk split
        ((8, 6), (2, 2), (Shard(0), Shard(1))),
        ((8, 6), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),  # FSDP over a TP colwise shard
        ((12, 6), (2, 3), (_StridedShard(0, split_factor=3), Shard(0))),
        ((8, 6), (2, 2), (Replicate(), Shard(0))),  # HSDP
        ((8, 6, 4), (2, 2, 2), (Replicate(), _StridedShard(1, split_factor=2), Shard(1))),
    ],
)
def test_local_intervals_match_torch_and_partition_the_tensor(shape, mesh_shape, placements):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    seen = torch.zeros(shape, dtype=torch.long)
    for coord in _all_coordinates(mesh_shape):
        intervals = local_intervals(shape, placements, mesh_shape, coord)
        local_shape, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
        assert tuple(sum(b - a for a, b in r) for r in intervals) == tuple(local_shape)
        assert tuple(r[0][0] if r else 0 for r in intervals) == tuple(o if s else 0 for o, s in zip(offset, local_shape))
        spec = ShardSpec("x", 0, 0, 0, 0, 1, intervals=intervals)
        local = slice_tensor(full, spec)
        # the byte runs read the same elements, in the local tensor's order
        flat = torch.cat([full.reshape(-1)[s : s + n] for s, n in interval_runs(shape, intervals)] or [torch.empty(0, dtype=torch.long)])
        assert torch.equal(flat, local.reshape(-1))
        seen.reshape(-1)[local.reshape(-1)] += 1
    replicas = 1
    for n, p in zip(mesh_shape, placements):
        replicas *= n if isinstance(p, Replicate) else 1
    assert torch.all(seen == replicas)


def _chunk(t, n, i):
    chunks = t.chunk(n) if len(t) else ()
    return chunks[i] if i < len(chunks) else t[:0]


@pytest.mark.parametrize("size", [0, 1, 5, 8, 13, 24])
@pytest.mark.parametrize("split_factor,num_chunks", [(1, 2), (2, 2), (3, 2), (2, 3), (4, 4)])
def test_a_strided_shard_is_each_rank_s_chunk_of_every_piece_as_torch_cuts_it(size, split_factor, num_chunks):
    ix = torch.arange(size)
    for rank in range(num_chunks):
        want = [int(i) for p in range(split_factor) for i in _chunk(_chunk(ix, split_factor, p), num_chunks, rank)]
        assert strided_shard_indices(size, split_factor, num_chunks, rank) == want
        offset_mode = getattr(sys.modules["torch.distributed.tensor.placement_types"], "_StridedShardOffsetMode", None)
        if offset_mode is not None:  # torch's own arithmetic, where this release exposes the index list (2.13+)
            _, theirs = _StridedShard(0, split_factor=split_factor).local_shard_size_and_offset(size, num_chunks, rank, offset_mode.ALL)
            assert list(theirs) == want


def test_adjacent_runs_merge_into_one_read():
    # dims after the last partial one are whole, so each kept row of dim 0 is one run; consecutive rows merge
    assert interval_runs((4, 3), (((0, 4),), ((0, 3),))) == [(0, 12)]
    assert interval_runs((4, 3), (((1, 3),), ((0, 3),))) == [(3, 6)]
    assert interval_runs((4, 3), (((0, 1), (2, 4)), ((0, 3),))) == [(0, 3), (6, 6)]
    assert interval_runs((2, 4), (((0, 2),), ((1, 3),))) == [(1, 2), (5, 2)]


class _AcceleratorMesh:
    """What ``rank_device`` reads of transformers' mesh manager (``get_mesh("tp").device_type``), for a mesh of a
    device type this machine lacks: a CUDA mesh cannot be built without CUDA."""

    def __init__(self, device_type: str):
        self.device_type = device_type

    def get_mesh(self, name: str):
        assert name == "tp"
        return self


def test_an_accelerator_mesh_puts_each_rank_on_its_local_accelerator_as_transformers_does(monkeypatch):
    from lowmem_hf.distributed.tp import TPRequest, rank_device

    monkeypatch.setenv("LOCAL_RANK", "1")
    on_cuda = TPRequest(plan="auto", tp_size=2, tp_rank=1, distributed=True, mesh_manager=_AcceleratorMesh("cuda"))
    assert rank_device(on_cuda, torch.device("cpu")) == torch.device("cuda", 1)  # the ambient device yields
    assert rank_device(on_cuda, torch.device("cuda")) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"device=cuda:0 but this rank's mesh is on cuda:1 \(LOCAL_RANK=1"):
        rank_device(on_cuda, torch.device("cuda", 0))
    on_cpu = TPRequest(plan="auto", tp_size=2, tp_rank=1, distributed=True, mesh_manager=_AcceleratorMesh("cpu"))
    assert rank_device(on_cpu, torch.device("cpu")) == torch.device("cpu")
    alone = TPRequest(plan="auto", tp_size=2, tp_rank=1, distributed=False)
    assert rank_device(alone, torch.device("cpu")) == torch.device("cpu")
    assert rank_device(None, torch.device("cpu")) == torch.device("cpu")


# -- real process groups ----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def _compare(ours, theirs) -> list[str]:
    problems = []
    theirs_params = dict(theirs.named_parameters())
    for n, p in ours.named_parameters():
        t = theirs_params.get(n)
        if t is None:
            problems.append(f"{n}: not in transformers' model")
            continue
        if type(p.data) is not type(t.data):
            problems.append(f"{n}: {type(p.data).__name__} vs {type(t.data).__name__}")
        elif hasattr(t.data, "placements"):
            if p.data.placements != t.data.placements or p.data.device_mesh != t.data.device_mesh:
                problems.append(f"{n}: placements {p.data.placements} vs {t.data.placements}")
            if not torch.equal(_local(p.data), _local(t.data)) or p.data.dtype != t.data.dtype:
                problems.append(f"{n}: local shard differs")
        elif not torch.equal(p.data, t.data):
            problems.append(f"{n}: differs")
    for attr in ("_tp_size", "_fsdp_size", "tp_size", "is_distributed_loading_by_transformers", "_is_fsdp_managed_module"):
        if getattr(ours, attr, None) != getattr(theirs, attr, None):
            problems.append(f"attribute {attr}: {getattr(ours, attr, None)} vs {getattr(theirs, attr, None)}")
    if type(ours).__name__ != type(theirs).__name__:
        problems.append(f"class {type(ours).__name__} vs {type(theirs).__name__}")
    if ours.config.distributed_config.to_dict() != theirs.config.distributed_config.to_dict():
        problems.append("config.distributed_config differs")
    if ours._device_mesh.mesh.tolist() != theirs._device_mesh.mesh.tolist():
        problems.append("_device_mesh differs")
    tied_ours = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    tied_theirs = theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight
    if tied_ours != tied_theirs:
        problems.append(f"tying {tied_ours} vs {tied_theirs}")
    return problems


def _load_and_check(path: str, sizes: dict, ids: torch.Tensor, forward: bool = True, **extra) -> dict:
    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        expected = single(ids).logits
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, distributed_config=DistributedConfig(**sizes))
    dist.barrier()  # rchar counts socket reads too: no gloo traffic of other ranks inside the load
    before = _rchar()
    ours, report = lowmem_hf.LowMemAutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True, **(extra or {"distributed_config": DistributedConfig(**sizes)})
    )
    rchar = _rchar() - before
    dist.barrier()
    problems = _compare(ours, theirs)
    if forward:
        with torch.no_grad():
            logits = ours(ids).logits
    loaded = [p for n, p in ours.named_parameters() if n in report.dtype_decisions]
    return {
        "problems": problems,
        "max_diff": (logits - expected).abs().max().item() if forward else None,
        "rchar": rchar,
        "local_bytes": sum(_local(p.data).numel() * p.element_size() for p in loaded),
        "header_bytes": report.header_bytes,
        "gap_bytes": report.gap_bytes,
        "placements": sorted({str(tuple(p.data.placements)) for p in loaded if hasattr(p.data, "placements")}),
    }


def _expect_error(fn) -> str:
    try:
        fn()
    except (ValueError, NotImplementedError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _worker(rank: int, world: int, port: int, paths: dict, out_dir: str, trainer_args: list | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    ids = (torch.arange(16).reshape(2, 8) * 5 + 1) % 96
    Causal = lowmem_hf.LowMemAutoModelForCausalLM
    try:
        for mesh_name, sizes in MESHES[world].items():
            for family in FAMILIES:
                results[f"{mesh_name}/{family}"] = _load_and_check(paths[family], sizes, ids)
        if world == 2:
            results["fsdp2/llama_uneven"] = _load_and_check(paths["llama_uneven"], MESHES[2]["fsdp2"], ids)
            # FSDP2 policies and a plan override reach transformers' engine untouched: the same wrapping and shards.
            # (No forward: CPU offload pins memory, which needs an accelerator; bf16 compute is not the fp32 reference.
            # No rchar bound: this process also reads ~40 KB of other files here; the read path is the one checked above.)
            options = dict(fsdp_cpu_offload=True, fsdp_mixed_precision=True, fsdp_plan={"model.norm": "keep_full_weight"})
            results["fsdp2+options/qwen2_tied"] = _load_and_check(paths["qwen2_tied"], {**MESHES[2]["fsdp2"], **options}, ids, forward=False)
        if world == 4:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
            results["device_mesh/llama"] = _load_and_check(paths["llama"], MESHES[4]["tp2xfsdp2"], ids, device_mesh=mesh)
            results["errors"] = {
                "world": _expect_error(lambda: Causal.from_pretrained(paths["llama"], distributed_config=DistributedConfig(fsdp_size=2))),
                "product": _expect_error(lambda: Causal.from_pretrained(paths["llama"], distributed_config=DistributedConfig(tp_size=2, fsdp_size=4))),
                "mesh": _expect_error(lambda: Causal.from_pretrained(paths["llama"], device_mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp")), distributed_config=DistributedConfig(fsdp_size=4))),
                "tp_dim": _expect_error(lambda: Causal.from_pretrained(paths["llama_uneven"], distributed_config=DistributedConfig(tp_size=4))),
                "heads": _expect_error(lambda: Causal.from_pretrained(paths["llama"], distributed_config=DistributedConfig(tp_size=4))),
            }
        if trainer_args is not None:
            sys.path.insert(0, os.path.join(REPO, "examples"))
            import finetune_fsdp_tp

            finetune_fsdp_tp.main(trainer_args)
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_rank(results: dict, rank: int) -> None:
    for case, r in results.items():
        if case == "errors":
            continue
        assert not r["problems"], (rank, case, r["problems"])
        assert r["max_diff"] is None or r["max_diff"] < 1e-4, (rank, case, r["max_diff"])
        # this rank's shards + replicated tensors (all counted in local_bytes) + headers, within 2%, plus what the
        # report says was copied between the runs of dim-1 slices (files in the page cache: one read per row band)
        if "+options" not in case:
            assert r["rchar"] <= (r["local_bytes"] + r["header_bytes"]) * 1.02 + r["gap_bytes"], (rank, case, r)


def test_fsdp2_ranks_load_their_shards_like_transformers(checkpoints, tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), checkpoints, str(tmp_path), None), nprocs=2, join=True)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 5, results.keys()
        _check_rank(results, rank)


def _finetune_args(model: str, out: str, losses: str, *, distributed: bool) -> list:
    args = ["--model", model, "--output-dir", out, "--steps", "5", "--losses-out", losses]
    return args + (["--tp-size", "2", "--fsdp-size", "2", "--allow-cpu-tp"] if distributed else ["--no-dist", "--dp-size", "2"])


def _logits(path: str) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=(torch.arange(20).reshape(2, 10) * 7 + 3) % 96).logits


def test_hsdp_and_tp_x_fsdp_meshes_load_and_train_like_transformers(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    trainer = _finetune_args(checkpoints["llama"], str(tmp_path / "tp"), str(tmp_path / "tp.json"), distributed=True)
    mp.spawn(_worker, args=(4, _free_port(), checkpoints, str(tmp_path), trainer), nprocs=4, join=True)
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        errors = results.pop("errors")
        assert len(results) == 7, results.keys()
        _check_rank(results, rank)
        # TP and FSDP shard q_proj's rows both: FSDP2 strides over the TP shard
        assert any("_StridedShard" in p or "_S(" in p for p in results["tp2xfsdp2/llama"]["placements"]), results["tp2xfsdp2/llama"]["placements"]
        assert "(Replicate(), Shard(dim=0))" in results["hsdp2x2/llama"]["placements"], results["hsdp2x2/llama"]["placements"]
        assert "DistributedConfig(dp_replicate_size=1, fsdp_size=2, tp_size=1) needs dp_replicate_size * fsdp_size * tp_size = 2 ranks, but the world has 4" in errors["world"], errors
        assert "= 8 ranks, but the world has 4" in errors["product"], errors
        assert "device_mesh has fsdp=2 but distributed_config has fsdp_size=4" in errors["mesh"], errors
        assert "num_key_value_heads=2 does not divide by tp_size=4" in errors["heads"], errors
        assert "model.embed_tokens.weight has 1025 along dimension 0 (shape [1025, 128]), which tp_size=4 does not divide" in errors["tp_dim"], errors

    # the Trainer: 5 steps under TP2 x FSDP2 match one process taking the same global batches
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import finetune_fsdp_tp

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    finetune_fsdp_tp.main(_finetune_args(checkpoints["llama"], str(tmp_path / "ref"), str(tmp_path / "ref.json"), distributed=False))
    sharded = json.loads((tmp_path / "tp.json").read_text())
    reference = json.loads((tmp_path / "ref.json").read_text())
    assert len(sharded) == len(reference) == 5
    assert sharded == pytest.approx(reference, abs=1e-5, rel=0), (sharded, reference)
    # save_model gathered the shards into one ordinary checkpoint that reloads in one process
    tp_logits, ref_logits = _logits(str(tmp_path / "tp")), _logits(str(tmp_path / "ref"))
    assert (ref_logits - _logits(checkpoints["llama"])).abs().max() > 1e-3, "training did not change the model"
    torch.testing.assert_close(tp_logits, ref_logits, atol=1e-5, rtol=0)

