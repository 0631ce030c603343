"""Configs of the transformers model families hicache is tested on: tiny ones for the CPU
suite and the demo, and realistic widths (1–3 B parameters) for the GPU benchmark.

Every model is built from its config with random weights: nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

#: The families whose layers hicache maps (see :mod:`hicache.integrations.transformers_layout`),
#: hybrid ones first; ``gemma3_text`` is the FULL+SWA model and ``llama`` attention only.
FAMILIES = (
    "jamba",
    "bamba",
    "granitemoehybrid",
    "falcon_h1",
    "zamba2",
    "nemotron_h",
    "qwen3_next",
    "lfm2",
    "gemma3_text",
    "llama",
)

_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

_MAMBA2_TINY: dict[str, Any] = {
    "mamba_d_state": 8,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}

_TINY: dict[str, dict[str, Any]] = {
    "jamba": {
        "num_hidden_layers": 4,
        "attn_layer_period": 4,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
        "use_mamba_kernels": False,
    },
    "bamba": {
        "num_hidden_layers": 4,
        "attn_layer_indices": [1],
        **_MAMBA2_TINY,
    },
    "granitemoehybrid": {
        "num_hidden_layers": 4,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "shared_intermediate_size": 32,
        **_MAMBA2_TINY,
    },
    "falcon_h1": {
        "num_hidden_layers": 3,
        "head_dim": 8,
        **_MAMBA2_TINY,
        "mamba_d_ssm": 64,
    },
    "zamba2": {
        "num_hidden_layers": 4,
        "hybrid_layer_ids": [1, 3],
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "num_mem_blocks": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_headdim": 16,
        "n_mamba_heads": 4,
        "mamba_ngroups": 1,
        "chunk_size": 16,
        "use_mem_rope": True,
        "adapter_rank": 4,
    },
    "nemotron_h": {
        "num_hidden_layers": 4,
        "hybrid_override_pattern": "M*-M",
        "head_dim": 8,
        "ssm_state_size": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 16,
    },
    "qwen3_next": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "head_dim": 8,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "num_experts": 2,
        "num_experts_per_tok": 1,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "decoder_sparse_step": 1,
    },
    "lfm2": {
        "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "conv_L_cache": 3,
        "block_auto_adjust_ff_dim": False,
    },
    "gemma3_text": {
        "num_hidden_layers": 4,
        "head_dim": 8,
        "sliding_window": 9,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "query_pre_attn_scalar": 8,
    },
    "llama": {"num_hidden_layers": 3},
}


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny (tens of thousands of parameters) fp32 config of ``family``."""
    from transformers import AutoConfig

    if family not in _TINY:
        raise ValueError(f"unknown family {family!r}; use one of {', '.join(FAMILIES)}")
    kwargs = {**_TINY_COMMON, **_TINY[family], **overrides}
    config = AutoConfig.for_model(family, **kwargs)
    _use_torch_paths(config)
    return config


def _use_torch_paths(config: Any) -> None:
    # Eager attention and the pure-torch Mamba paths: the same arithmetic on any machine.
    config._attn_implementation = "eager"
    if hasattr(config, "use_mamba_kernels"):
        config.use_mamba_kernels = False


_REALISTIC: dict[str, dict[str, Any]] = {
    # ~1.3 B parameters: 24 layers, 1 attention layer in 4 (bamba, Mamba2 mixers).
    "bamba": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "attn_layer_indices": [3, 7, 11, 15, 19, 23],
        "mamba_d_state": 128,
        "mamba_n_heads": 64,
        "mamba_d_head": 64,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "max_position_embeddings": 40960,
    },
    # ~1.1 B parameters, Llama-like (the anchor's model).
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 40960,
    },
}


#: The families with a realistic config (``hicache run-hf --size realistic``).
REALISTIC_FAMILIES = tuple(_REALISTIC)


def realistic_config(family: str) -> Any:
    """A 1–3 B parameter config of ``family`` (``bamba`` or ``llama``), SDPA attention."""
    from transformers import AutoConfig

    if family not in _REALISTIC:
        raise ValueError(f"no realistic config for {family!r}; use one of {sorted(_REALISTIC)}")
    config = AutoConfig.for_model(family, **_REALISTIC[family])
    config._attn_implementation = "sdpa"
    return config
