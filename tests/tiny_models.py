"""Tiny configs for any transformers model type, shrunk generically from the config class's defaults.

Most default configs describe the released checkpoint (hidden 4096, 32 layers, vocab 32000): far too big to
build hundreds of times in a test. ``tiny_config(model_type)`` starts from those defaults and shrinks every
size attribute it knows by name (``SIZES``), recursively through sub-configs (text, vision, audio, encoder,
decoder), then repairs what the shrink breaks: per-layer lists cut to the new layer count, token ids kept
inside the vocabulary, heads that divide the width, backbone outputs moved to stages that still exist. Policy
is data: the tables below, no per-model branches.
A type whose defaults cannot be shrunk this way fails to build, and the sweep skips it with the reason.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import CONFIG_MAPPING, PreTrainedConfig

WIDTH = 32
HEADS = 4

# attribute name -> tiny value; applied wherever the attribute is an int larger than the tiny value
SIZES: dict[str, int] = {
    **dict.fromkeys(
        ("hidden_size", "d_model", "n_embd", "embed_dim", "hidden_dim", "word_embed_proj_dim", "projection_dim",
         "embedding_size", "text_embed_dim", "vision_embed_dim", "proj_dim", "d_embed", "n_embed", "dim",
         "encoder_hidden_size", "decoder_hidden_size", "model_dim", "emb_dim", "hidden_channels", "output_dim"),
        WIDTH,
    ),
    **dict.fromkeys(
        ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
         "num_decoder_layers", "num_encoder_layers", "depth", "text_num_layers", "num_blocks"),
        1,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
         "num_heads", "encoder_num_attention_heads", "decoder_num_attention_heads"),
        HEADS,
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(
        ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_hidden_size",
         "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_dim", "d_inner", "inner_size",
         "hidden_dim_ffn", "intermediate_dim", "mlp_hidden_dim"),
        2 * WIDTH,
    ),
    **dict.fromkeys(("vocab_size", "n_vocab", "text_vocab_size"), 128),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"), 128),
    **dict.fromkeys(("head_dim", "d_kv", "d_head"), WIDTH // HEADS),
    "mamba_n_heads": HEADS,
    "mamba_d_ssm": WIDTH,  # = mamba_n_heads * mamba_d_head where a config states both (falcon_h1: 8)
    "mamba_d_head": 2 * WIDTH // HEADS,  # set from mamba_expand (2) * hidden_size / mamba_n_heads when built
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "image_size": 32,
    "patch_size": 8,
    "num_channels": 3,
}
# per-stage lists (convolutional and hierarchical models): each element capped at the tiny value
LIST_SIZES: dict[str, int] = {
    **dict.fromkeys(("depths", "num_layers_per_stage", "stage_depths"), 1),
    **dict.fromkeys(
        ("hidden_sizes", "embed_dims", "conv_dim", "neck_hidden_sizes", "channels", "out_channels_list",
         "embedding_dims", "stage_channels", "widths", "dims"),
        WIDTH,
    ),
    "num_attention_heads_per_layer": HEADS,
}
# per-layer lists, cut to the new layer count
LAYER_LISTS = (
    "layer_types", "layers_block_type", "block_types", "mlp_layer_types", "attention_layers", "kv_source_layers",
    "num_attention_heads_per_layer",
)
# lists of layer indices, kept to the indices below the new layer count
LAYER_INDEX_LISTS = ("attn_layer_indices", "mlp_only_layers")


def _int_attr(config: PreTrainedConfig, name: str) -> int | None:
    value = getattr(config, name, None) if name in config.__dict__ else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def shrink(config: PreTrainedConfig) -> PreTrainedConfig:
    """A copy of ``config`` with every known size attribute made tiny, sub-configs included."""
    config = copy.deepcopy(config)
    layers_before = {name: _int_attr(config, name) for name in SIZES if SIZES[name] == 1}
    for name, tiny in SIZES.items():
        value = _int_attr(config, name)
        if value is not None and value > tiny:
            setattr(config, name, tiny)
    for name, tiny in LIST_SIZES.items():
        value = config.__dict__.get(name)
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            setattr(config, name, type(value)(min(v, tiny) for v in value))
    counted_by = next((name for name, before in layers_before.items() if before), None)  # the layer count
    layers = _int_attr(config, counted_by) if counted_by else None
    for name in (*LAYER_LISTS, *LAYER_INDEX_LISTS) if layers is not None else ():
        value = config.__dict__.get(name)  # stored lists only (some configs derive them in a property)
        if isinstance(value, list):
            setattr(config, name, value[:layers] if name in LAYER_LISTS else [
                i for i in value if isinstance(i, int) and i < layers
            ])
    stages = config.__dict__.get("stage_names")
    if (isinstance(stages, list) and layers is not None and len(stages) == layers_before[counted_by] + 1 > layers + 1
            and hasattr(config, "set_output_features_output_indices")):
        # a backbone with one stage per layer (ViT-like): its outputs name stages the shrink removed
        config.stage_names = stages[: layers + 1]
        config.set_output_features_output_indices(out_features=None, out_indices=None)
    vocab = _int_attr(config, "vocab_size")
    if vocab is not None:  # special tokens past the shrunk vocabulary get the last ids, in name order
        outside = sorted(
            name for name, value in config.__dict__.items()
            if (name.endswith("_token_id") or name.endswith("_token_index")) and isinstance(value, int) and value >= vocab
        )
        for i, name in enumerate(outside):
            setattr(config, name, vocab - 1 - i)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if isinstance(sub, PreTrainedConfig):
            setattr(config, name, shrink(sub))
    return config


def tiny_config(model_type: str) -> PreTrainedConfig:
    """``CONFIG_MAPPING[model_type]()`` shrunk (see the module doc); raises whatever the config class raises."""
    return shrink(CONFIG_MAPPING[model_type]())


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())
