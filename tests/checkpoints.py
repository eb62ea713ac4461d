"""Tiny checkpoints for the tests: real transformers models, saved and rewritten in every format we load.

Every checkpoint starts as ``save_pretrained`` output (so keys, tying and config are transformers' own),
then is rewritten as one safetensors file, sharded safetensors, or sharded ``torch.save`` ``.bin``
(transformers 5 cannot write ``.bin`` itself).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Callable

import torch
import transformers
from safetensors.torch import load_file, save_file

FORMATS = ("safetensors", "sharded", "bin")


@dataclass(frozen=True)
class ModelCase:
    """A tiny model: how to build it, which auto classes load it, and how to make its inputs."""

    name: str
    build: Callable[[], transformers.PreTrainedModel]
    auto_classes: tuple[str, ...]
    inputs: Callable[[], dict]
    mutate: Callable[[dict], dict] | None = None
    """Rewrites the saved tensors (legacy keys, extra buffers) before they are written."""


def _ids(vocab: int, n: int = 10) -> torch.Tensor:
    return (torch.arange(2 * n).reshape(2, n) * 7 + 3) % vocab


def _llama(tie: bool):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tie, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(cfg)


def _qwen2_tied():
    cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=64,
    )
    return transformers.Qwen2ForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg)


def _gpt2_legacy_buffers(tensors: dict) -> dict:
    # Checkpoints written by transformers < 4.x carry the causal-mask buffers; they must be ignored.
    out = dict(tensors)
    for i in range(2):
        out[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(32, 32, dtype=torch.bool)).view(1, 1, 32, 32)
        out[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    return out


def _bert():
    cfg = transformers.BertConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64,
    )
    return transformers.BertForPreTraining(cfg)


def _bert_legacy_layernorm(tensors: dict) -> dict:
    # Old TF-converted BERT checkpoints name LayerNorm parameters gamma/beta; transformers renames them on load.
    return {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v for k, v in tensors.items()}


def _t5():
    cfg = transformers.T5Config(
        vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    return transformers.MixtralForCausalLM(cfg)


MODELS: dict[str, ModelCase] = {
    c.name: c
    for c in [
        ModelCase("llama", lambda: _llama(tie=False), ("AutoModelForCausalLM",), lambda: {"input_ids": _ids(96)}),
        ModelCase("qwen2_tied", _qwen2_tied, ("AutoModelForCausalLM",), lambda: {"input_ids": _ids(96)}),
        ModelCase("gpt2", _gpt2, ("AutoModelForCausalLM",), lambda: {"input_ids": _ids(96)}, _gpt2_legacy_buffers),
        ModelCase(
            "bert", _bert, ("AutoModel", "AutoModelForSequenceClassification"), lambda: {"input_ids": _ids(96)}
        ),
        ModelCase(
            "bert_legacy_names", _bert, ("AutoModel", "AutoModelForSequenceClassification"),
            lambda: {"input_ids": _ids(96)}, _bert_legacy_layernorm,
        ),
        ModelCase(
            "t5", _t5, ("AutoModelForSeq2SeqLM", "AutoModel"),
            lambda: {"input_ids": _ids(96), "decoder_input_ids": _ids(96, 6)},
        ),
        ModelCase("mixtral", _mixtral, ("AutoModelForCausalLM",), lambda: {"input_ids": _ids(96)}),
    ]
}


def save_reference(case: ModelCase, folder: str, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """``save_pretrained`` a seeded instance into ``folder``; return its saved tensors (after ``case.mutate``)."""
    torch.manual_seed(seed)
    model = case.build().to(dtype)
    model.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    os.remove(path)
    return case.mutate(tensors) if case.mutate else tensors


def write_weights(folder: str, tensors: dict, fmt: str, *, shards: int = 3) -> str:
    """Write ``tensors`` into ``folder`` as ``fmt`` (see ``FORMATS``); config files must already be there."""
    keys = list(tensors)
    if fmt == "safetensors":
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return folder
    groups = [keys[i::shards] for i in range(shards)]  # interleaved: every shard holds parts of every layer
    weight_map, total = {}, 0
    for i, group in enumerate(groups, start=1):
        if fmt == "sharded":
            name = f"model-{i:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k].contiguous() for k in group}, os.path.join(folder, name), metadata={"format": "pt"})
        elif fmt in ("bin", "bin_legacy"):
            name = f"pytorch_model-{i:05d}-of-{shards:05d}.bin"
            torch.save(
                {k: tensors[k].contiguous() for k in group},
                os.path.join(folder, name),
                _use_new_zipfile_serialization=fmt == "bin",
            )
        else:
            raise ValueError(fmt)
        for k in group:
            weight_map[k] = name
            total += tensors[k].numel() * tensors[k].element_size()
    index = "model.safetensors.index.json" if fmt == "sharded" else "pytorch_model.bin.index.json"
    with open(os.path.join(folder, index), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return folder


def make_checkpoint(root: str, case_name: str, fmt: str, *, dtype: torch.dtype = torch.float32) -> str:
    """A folder with ``case_name`` saved in ``fmt`` (cached under ``root``)."""
    folder = os.path.join(root, f"{case_name}-{fmt}-{str(dtype).removeprefix('torch.')}")
    if os.path.isdir(folder):
        return folder
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tensors = save_reference(MODELS[case_name], tmp, dtype=dtype)
    write_weights(tmp, tensors, fmt)
    os.rename(tmp, folder)
    return folder
