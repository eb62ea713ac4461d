"""Synthetic Llama checkpoints for the benchmarks (cached on disk, deterministic values).

Public API (reused by other benchmarks, e.g. tensor-parallel loading):

    make_llama_checkpoint(workdir, size_gb, dtype) -> Path   sharded safetensors + index
    make_bin_twin(safetensors_dir, out_dir) -> Path          same tensors as sharded .bin
    tensor_fingerprint(t) -> dict                            what the loaded values must match

torch/transformers are imported inside the functions so that importing this module (the child
does, for ``tensor_fingerprint``) costs nothing extra.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

# Bump when the generated content changes so stale caches are rebuilt.
GENERATOR_VERSION = 1
SEED = 1234
MARKER = "bench_checkpoint.json"  # written last: its presence means "complete"
FINGERPRINT = "bench_fingerprint.json"
VOCAB = 32000
N_SAMPLES = 16  # sampled elements per tensor in the fingerprint


# --------------------------------------------------------------------------------------------
# Architecture
# --------------------------------------------------------------------------------------------
def _n_params(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> int:
    head_dim = hidden // heads
    attn = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim  # q,o + k,v (no bias)
    mlp = 3 * hidden * inter  # gate, up, down
    per_layer = attn + mlp + 2 * hidden  # + 2 RMSNorm weights
    return 2 * vocab * hidden + layers * per_layer + hidden  # embed + lm_head (untied) + norm


def llama_dims(size_gb: float) -> dict[str, int]:
    """Llama dimensions giving ~``size_gb`` GB (1e9 bytes) *in fp32*.

    Uses hidden 1024 / intermediate 4096 / vocab 32000 / 16 heads / 8 KV heads and tunes the
    layer count. Sizes too small for the 65M-parameter embeddings of hidden 1024 fall back to a
    narrower hidden size so the model still has >= 2 layers. The dims depend only on size_gb, so
    the fp32 and bf16 checkpoints of one size are the same model.
    """
    target = size_gb * 1e9 / 4
    for hidden in (1024, 512, 256, 128):
        d = dict(hidden=hidden, inter=4 * hidden, heads=16, kv_heads=8, vocab=VOCAB)
        emb_only = _n_params(layers=0, **d)
        per_layer = _n_params(layers=1, **d) - emb_only
        if emb_only + 2 * per_layer <= target or hidden == 128:
            layers = max(1, round((target - emb_only) / per_layer))
            return dict(d, layers=layers)
    raise AssertionError("unreachable")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# --------------------------------------------------------------------------------------------
# Fingerprints: cheap per-tensor summary to check that a loader produced the right values
# --------------------------------------------------------------------------------------------
def tensor_fingerprint(t) -> dict[str, Any]:
    """sum / sum of squares (float64) and N_SAMPLES exact elements at fixed flat positions.

    Computed identically by the generator and by the benchmark child, so a loader that returns
    the wrong values (garbage, wrong rounding, a transpose, a swapped tensor) is caught.
    """
    import torch

    flat = t.detach().reshape(-1)
    n = flat.numel()
    d = flat.to(torch.float64)
    idx = sorted({(i * (n - 1)) // max(1, N_SAMPLES - 1) for i in range(N_SAMPLES)}) if n else []
    fp = {
        "shape": list(t.shape),
        "sum": d.sum().item(),
        "sumsq": (d * d).sum().item(),
        "idx": idx,
        "samples": [flat[i].item() for i in idx],
    }
    del d
    return fp


def fingerprint_matches(fp: dict[str, Any], expected: dict[str, Any]) -> bool:
    if fp["shape"] != expected["shape"] or fp["idx"] != expected["idx"]:
        return False
    if fp["samples"] != expected["samples"]:  # exact: same values in the same dtype
        return False
    # Float64 reductions may be summed in a different order: compare with a tolerance scaled by
    # the tensor's norm (sums of zero-mean values are near 0, so a pure rel_tol would be flaky).
    scale = math.sqrt(max(expected["sumsq"], 0.0)) + 1e-30
    return math.isclose(fp["sum"], expected["sum"], rel_tol=1e-9, abs_tol=1e-9 * scale) and (
        math.isclose(fp["sumsq"], expected["sumsq"], rel_tol=1e-9)
    )


# --------------------------------------------------------------------------------------------
# Checkpoint generation
# --------------------------------------------------------------------------------------------
def _read_marker(path: Path) -> dict | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _fresh_dir(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _shard_limit_bytes(total: int) -> int:
    """``_shard_size`` in bytes (transformers reads "500MB" as 500 * 10**6) for a checkpoint of ``total`` bytes."""
    return 500 * 10**6 if total >= 1e9 else max(1, int(total / 4e6)) * 10**6


def _shard_size(model) -> str:
    """500MB shards like real hubs; small test checkpoints get ~4 shards so that they still
    exercise the sharded (index.json) code path."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if total >= 1e9:
        return "500MB"
    return f"{max(1, int(total / 4e6))}MB"


def make_llama_checkpoint(workdir, size_gb: float, dtype, *, dims: dict[str, int] | None = None, name: str | None = None) -> Path:
    """Sharded safetensors Llama checkpoint (500MB shards + model.safetensors.index.json;
    checkpoints under 1 GB use ~1/4 of their size per shard so they are still sharded).

    ``size_gb`` is the size in fp32; ``dtype`` (torch.float32 / torch.bfloat16 / ...) is the
    stored dtype. Values are deterministic (seeded) and identical across dtypes up to rounding,
    so an fp32 checkpoint loaded as bf16 must equal the bf16 checkpoint exactly. Cached in
    ``workdir/llama-<size>gb-<dtype>``; rebuilt if the completion marker is missing/stale.
    Also writes ``bench_fingerprint.json`` ({dtype: {key: tensor_fingerprint}}) for float32
    and bfloat16 (the values any correct loader must produce for that target dtype).

    ``dims`` (``hidden``, ``inter``, ``layers``, ``heads``, ``kv_heads``, ``vocab``) gives the model's shape instead
    of ``size_gb`` (the shape sweep's real model widths), cached as ``workdir/llama-<name>-<dtype>``.
    """
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    label = f"{size_gb:g}gb" if dims is None else name
    dims = llama_dims(size_gb) if dims is None else dict(dims)
    name = _dtype_name(dtype)
    out = Path(workdir) / f"llama-{label}-{name}"
    want = {"version": GENERATOR_VERSION, "seed": SEED, "dims": dims, "dtype": name}
    marker = _read_marker(out)
    if marker is not None and all(marker.get(k) == v for k, v in want.items()):
        return out

    from transformers import LlamaConfig, LlamaForCausalLM

    print(f"[checkpoints] generating {out} ({dims}) ...", flush=True)
    _fresh_dir(out)
    config = LlamaConfig(
        hidden_size=dims["hidden"],
        intermediate_size=dims["inter"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        vocab_size=dims["vocab"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    # Build on meta (no allocation, no slow random init) for the names and shapes, then fill each tensor ourselves
    # (randn is ~100x faster than transformers' init, and deterministic) and write each shard once its last tensor
    # is made: a shard or two is in memory at a time, so a checkpoint larger than this machine's RAM
    # (bench_scale.py) can be made.
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(SEED)
    fingerprints: dict[str, dict] = {"float32": {}, "bfloat16": {}}
    params = dict(model.named_parameters())
    # the shards exactly as save_pretrained cuts them (huggingface_hub's split, on shapes only)
    split = split_torch_state_dict_into_shards(
        {k: torch.empty(p.shape, dtype=dtype, device="meta") for k, p in params.items()},
        filename_pattern="model{suffix}.safetensors", max_shard_size=_shard_limit_bytes(
            sum(p.numel() * dtype.itemsize for p in params.values())),
    )
    file_of = {key: f for f, keys in split.filename_to_tensors.items() for key in keys}
    pending = {f: dict.fromkeys(keys) for f, keys in split.filename_to_tensors.items()}
    with torch.no_grad():
        for key, p in params.items():
            w = torch.empty(p.shape, dtype=torch.float32)
            w.normal_(0.0, 0.02, generator=gen)
            if p.ndim == 1:  # RMSNorm weights: around 1, but not all identical
                w.add_(1.0)
            fingerprints["float32"][key] = tensor_fingerprint(w)
            fingerprints["bfloat16"][key] = tensor_fingerprint(w.to(torch.bfloat16))
            shard = pending[file_of[key]]
            shard[key] = w.to(dtype) if dtype != torch.float32 else w
            del w
            if all(t is not None for t in shard.values()):  # the shard's last tensor: write it, free it
                save_file(shard, str(out / file_of[key]), metadata={"format": "pt"})
                del pending[file_of[key]]
    index = {"metadata": {**split.metadata, "total_parameters": sum(p.numel() for p in params.values())},
             "weight_map": dict(sorted(file_of.items()))}
    if split.is_sharded:
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.dtype = dtype  # what config.json records as the checkpoint dtype
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    del model
    if not (out / "model.safetensors.index.json").exists():
        raise RuntimeError(f"{out}: expected a sharded checkpoint (size too small for 500MB shards?)")
    (out / FINGERPRINT).write_text(json.dumps(fingerprints))
    total = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    (out / MARKER).write_text(json.dumps(dict(want, bytes_on_disk=total), indent=1))
    return out


def make_bin_twin(safetensors_dir, out_dir) -> Path:
    """Copy a sharded safetensors checkpoint to the legacy sharded ``pytorch_model*.bin`` format.

    transformers 5 can no longer *write* .bin, so each safetensors shard is re-saved with
    ``torch.save(dict)`` as ``pytorch_model-0000k-of-0000n.bin`` plus a
    ``pytorch_model.bin.index.json``; config / generation config / fingerprint are copied.
    Cached: skipped if ``out_dir`` has a marker naming the same source marker.
    """
    import torch
    from safetensors.torch import load_file

    src, out = Path(safetensors_dir), Path(out_dir)
    src_marker = _read_marker(src)
    if src_marker is None:
        raise FileNotFoundError(f"{src} is not a complete benchmark checkpoint")
    want = {"version": GENERATOR_VERSION, "format": "bin", "source": src_marker}
    marker = _read_marker(out)
    if marker is not None and all(marker.get(k) == v for k, v in want.items()):
        return out

    print(f"[checkpoints] writing .bin twin {out} ...", flush=True)
    _fresh_dir(out)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, 1):
        fname = f"pytorch_model-{k:05d}-of-{len(shards):05d}.bin"
        tensors = load_file(src / shard)  # one shard at a time keeps memory at ~1 shard
        for key, t in tensors.items():
            weight_map[key] = fname
            total += t.numel() * t.element_size()
        torch.save(tensors, out / fname)  # zipfile format: loadable with mmap=True
        del tensors
    (out / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    for f in ("config.json", "generation_config.json", FINGERPRINT):
        if (src / f).exists():
            shutil.copy2(src / f, out / f)
    (out / MARKER).write_text(json.dumps(dict(want, bytes_on_disk=total), indent=1))
    return out


# Real models' shapes (their config.json values), for checkpoints with real headers and no data (sparse files).
REAL_SHAPES = {
    "llama3.2-1b": dict(hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
    "llama3-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8, vocab=128256, tied=False),
    "llama3-70b": dict(hidden=8192, inter=28672, layers=80, heads=64, kv_heads=8, vocab=128256, tied=False),
    "llama3.1-405b": dict(hidden=16384, inter=53248, layers=126, heads=128, kv_heads=8, vocab=128256, tied=False),
}
SPARSE_SHARD_BYTES = 5_000_000_000  # the Hub's usual shard size for these models


def make_sparse_llama(workdir, name: str, dtype=None, *, shard_bytes: int = SPARSE_SHARD_BYTES) -> Path:
    """A checkpoint of ``REAL_SHAPES[name]`` whose headers are real and whose data are holes (reads give zeros).

    Each shard is its safetensors header followed by a ``truncate`` to the full size: a 141 GB Llama-3-70B costs a
    few hundred KB of disk, and a planner or a loader reads it like the real one (tensor names, shapes, dtypes and
    offsets as transformers' ``save_pretrained`` lays them out, in ``shard_bytes`` shards). Cached in
    ``workdir/sparse-<name>-<dtype>`` behind a marker.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowmem_hf.formats.safetensors import encode_header

    dtype = dtype or torch.bfloat16
    dims = REAL_SHAPES[name]
    out = Path(workdir) / f"sparse-{name}-{_dtype_name(dtype)}"
    want = {"version": GENERATOR_VERSION, "sparse": name, "dims": dims, "dtype": _dtype_name(dtype), "shard_bytes": shard_bytes}
    marker = _read_marker(out)
    if marker is not None and all(marker.get(k) == v for k, v in want.items()):
        return out
    _fresh_dir(out)
    config = LlamaConfig(
        hidden_size=dims["hidden"], intermediate_size=dims["inter"], num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"], num_key_value_heads=dims["kv_heads"], vocab_size=dims["vocab"],
        max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=dims["tied"], dtype=dtype,
    )
    with torch.device("meta"):
        params = [(k, tuple(p.shape)) for k, p in LlamaForCausalLM(config).named_parameters()]
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for key, shape in params:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, dtype, shape))
        size += nbytes
    weight_map, total = {}, 0
    for i, items in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header = encode_header(items, {"format": "pt"})
        data = sum(math.prod(shape) * dt.itemsize for _, dt, shape in items)
        with open(out / fname, "wb") as f:
            f.write(header)
            f.truncate(len(header) + data)  # the data section is a hole
        weight_map.update({key: fname for key, _, _ in items})
        total += data
    config.save_pretrained(out)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / MARKER).write_text(json.dumps(dict(want, total_size=total, n_tensors=len(params), n_shards=len(shards)), indent=1))
    return out


def prewarm_page_cache(path) -> int:
    """Read every file of a checkpoint once so all loaders start from a warm page cache."""
    n = 0
    for f in sorted(Path(path).iterdir()):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while chunk := fh.read(16 << 20):
                    n += len(chunk)
    return n


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches`` (needs root and a writable /proc/sys)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Generate (or reuse) the benchmarks' Llama checkpoint; prints its folder.")
    parser.add_argument("--size-gb", type=float, default=2.0, help="size in fp32, 1 GB = 1e9 bytes")
    parser.add_argument("--dtype", default="float32", help="the stored dtype (float32, bfloat16, ...)")
    parser.add_argument("--workdir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_work"))
    parser.add_argument("--sparse", choices=sorted(REAL_SHAPES), help="a real model's shape with holes for data instead")
    args = parser.parse_args()

    import torch

    if args.sparse:
        print(make_sparse_llama(args.workdir, args.sparse, getattr(torch, args.dtype)))
    else:
        print(make_llama_checkpoint(args.workdir, args.size_gb, getattr(torch, args.dtype)))
