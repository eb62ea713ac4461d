"""The pure arithmetic of tensor-parallel slices: bounds, byte runs, chunks, and the errors before any read."""

import pytest
import torch

from lowmem_hf.plan.sharding import (
    STYLE_SHARDING,
    UnsupportedStyleError,
    check_head_divisibility,
    shard_specs,
    slice_bounds,
)
from lowmem_hf.runs import chunk_runs, element_runs, flat_box_runs
from lowmem_hf.types import ShardSpec


def spec(dim, start, stop):
    return ShardSpec("colwise", dim, start, stop, 0, 2)


@pytest.mark.parametrize("shape,dim,start,stop", [((6, 4), 0, 3, 6), ((6, 4), 1, 2, 4), ((2, 3, 4), 1, 1, 2), ((8,), 0, 4, 8)])
def test_element_runs_concatenate_to_the_slice(shape, dim, start, stop):
    full = torch.arange(torch.Size(shape).numel())
    expected = full.reshape(shape).narrow(dim, start, stop - start).reshape(-1)
    runs = element_runs(shape, spec(dim, start, stop))
    got = torch.cat([full[s : s + n] for s, n in runs])
    assert torch.equal(got, expected)


def test_dim0_slice_is_one_run_and_dim1_one_run_per_row():
    assert element_runs((6, 4), spec(0, 3, 6)) == [(12, 12)]
    assert element_runs((6, 4), spec(1, 2, 4)) == [(2, 2), (6, 2), (10, 2), (14, 2), (18, 2), (22, 2)]
    assert element_runs((6, 4), None) == [(0, 24)]


def test_chunk_runs_bound_every_chunk_and_keep_destinations_consecutive():
    runs = [(0, 5), (10, 5), (20, 5)]
    chunks = chunk_runs(runs, itemsize=4, chunk_bytes=28)  # 7 elements per chunk
    assert all(sum(n for *_, n in c) <= 7 for c in chunks)
    flat = [(s, d, n) for c in chunks for s, d, n in c]
    assert sum(n for *_, n in flat) == 15
    for c in chunks:
        assert all(c[i][1] + c[i][2] == c[i + 1][1] for i in range(len(c) - 1))
    assert chunks[0] == [(0, 0, 5), (10, 5, 2)]


@pytest.mark.parametrize("shape,cut_dim,cuts", [((6, 4), 0, (0, 2, 6)), ((6, 4), 1, (0, 1, 4)), ((2, 3, 4), 1, (0, 2, 3)), ((5,), 0, (0, 5)), ((), 0, ())])
def test_flat_box_runs_cut_a_flat_range_out_of_the_chunks_that_hold_it(shape, cut_dim, cuts):
    # a ZeRO-3 partition (a range of the flattened tensor) read from a TP job's DCP chunks (boxes along one dim)
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    boxes = [((), ())] if not shape else [
        (tuple(a if d == cut_dim else 0 for d in range(len(shape))), tuple(b - a if d == cut_dim else n for d, n in enumerate(shape)))
        for a, b in zip(cuts, cuts[1:])
    ]
    numel = full.numel()
    for start in range(numel + 1):
        for stop in range(start, numel + 1):
            got = torch.full((stop - start,), -1, dtype=full.dtype)
            for offsets, sizes in boxes:
                stored = full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
                for src, dst, n in flat_box_runs(shape, offsets, sizes, start, stop):
                    got[dst : dst + n] = stored[src : src + n]
            assert torch.equal(got, full.reshape(-1)[start:stop]), (start, stop)


def test_slice_bounds():
    assert [slice_bounds(12, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]


def test_styles_shard_the_dims_transformers_shards():
    # weight [out, in]: colwise splits out (Shard(0)), rowwise splits in (Shard(-1)), rowwise bias replicated
    assert STYLE_SHARDING["colwise"](2, "weight") == 0 and STYLE_SHARDING["colwise"](1, "bias") == 0
    assert STYLE_SHARDING["rowwise"](2, "weight") == 1 and STYLE_SHARDING["rowwise"](1, "bias") is None
    assert STYLE_SHARDING["embedding_rowwise"](2, "weight") == 0


def test_non_dividing_dimension_names_parameter_dim_and_sizes():
    with pytest.raises(ValueError, match=r"layers.0.mlp.up_proj.weight has 10 along dimension 0 .* tp_size=4 does not divide"):
        shard_specs({"layers.0.mlp.up_proj.weight": (10, 8)}, {"layers.0.mlp.up_proj.weight": "colwise"}, tp_rank=0, tp_size=4)


def test_unknown_style_names_style_and_module():
    with pytest.raises(UnsupportedStyleError, match=r"'packed_colwise' on layers.0.mlp.gate_up_proj"):
        shard_specs({"layers.0.mlp.gate_up_proj.weight": (8, 8)}, {"layers.0.mlp.gate_up_proj.weight": "packed_colwise"}, tp_rank=0, tp_size=2)


def test_heads_must_divide_even_when_rows_do():
    from transformers import LlamaConfig

    config = LlamaConfig(num_attention_heads=9, num_key_value_heads=9, hidden_size=72)
    specs = shard_specs({"model.layers.0.self_attn.q_proj.weight": (72, 72)}, {"model.layers.0.self_attn.q_proj.weight": "colwise"}, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match=r"num_attention_heads=9 does not divide by tp_size=2"):
        check_head_divisibility(config, specs, 2)


@pytest.mark.parametrize("shape, spec", [
    ((8, 6), None),
    ((8, 6), ShardSpec("colwise", 0, 2, 6, 1, 2)),
    ((8, 6), ShardSpec("rowwise", 1, 3, 6, 1, 2)),
    ((4, 6, 5), ShardSpec("rowwise", 1, 0, 0, 0, 2)),  # an empty slice
    ((40,), ShardSpec("zero3", 0, 7, 19, 0, 1, flat=True)),
    ((12, 10), ShardSpec("colwise", 0, 1, 11, 0, 2, intervals=(((1, 3), (7, 9)), ((0, 10),)))),
    ((12, 10), ShardSpec("rowwise", 1, 2, 8, 0, 2, intervals=(((3, 6),), ((2, 4), (6, 8))))),
    ((3, 12, 10), ShardSpec("x", 1, 1, 9, 0, 2, intervals=(((0, 3),), ((1, 3), (7, 9)), ((4, 5),)))),
])
def test_a_slice_s_extent_is_the_span_and_size_of_its_runs(shape, spec):
    from lowmem_hf.runs import element_extent, element_runs

    runs = element_runs(shape, spec)
    expected = (runs[0][0], runs[-1][0] + runs[-1][1], sum(n for _, n in runs)) if runs else (0, 0, 0)
    assert element_extent(shape, spec) == expected
