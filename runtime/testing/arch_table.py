"""Per-architecture facts for ``runtime.testing.arch_models``: config overrides and the
architectures that cannot be built, with the reason (docs/models.md "Architectures" lists them).
"""

from __future__ import annotations

from typing import Any, Final

# What an architecture needs beyond the generic tiny config: layer patterns that hold both layer
# kinds of a hybrid within 4 layers, nested configs, fields without a usable default.
_SF = ["sliding_attention", "full_attention"] * 2  # both kinds of a sliding-window hybrid
_GRANITE = {
    "logits_scaling": 1.0,
    "attention_multiplier": 0.25,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
}
_LFM2 = {
    "conv_L_cache": 3,
    "block_dim": 64,
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "block_auto_adjust_ff_dim": False,
    "full_attn_idxs": [1, 3],
}
_LLAMA4_TEXT = {
    "attention_chunk_size": 32,  # (i + 1) % 4 != 0: layers 0-2 chunked, 3 full
    "interleave_moe_layer_step": 2,
    "intermediate_size_mlp": 128,
    "num_experts_per_tok": 1,  # mlx-lm's llama4 routes to one expert only
    "no_rope_layers": [1, 1, 1, 0],
}
_KDA = {
    "kda_layers": [1, 3],  # 1-based: layers 0 and 2 linear, 1 and 3 full attention
    "full_attn_layers": [2, 4],
    "num_heads": 4,
    "head_dim": 16,
    "short_conv_kernel_size": 4,
}
_PER_LAYER_ROPE = {
    kind: {"rope_type": "default", "rope_theta": 10000.0}
    for kind in ("full_attention", "sliding_attention")
}
_GEMMA4 = {
    "layer_types": _SF,
    "num_kv_shared_layers": 0,
    "vocab_size_per_layer_input": 512,
    "hidden_size_per_layer_input": 16,
}
_MISTRAL_ROPE = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.0,
        "original_max_position_embeddings": 2048,
    }
}

OVERRIDES: Final[dict[str, dict[str, Any]]] = {
    "afm7": {"num_kv_reuse_layers": 2},
    "afmoe": {"layer_types": _SF, "num_dense_layers": 1},
    "apertus": {"post_norm": False, "qk_norm": True},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1},
    # Logits scaled down 16x (or soft-capped at 20) leave top-2 margins too close to call.
    "cohere": {"logit_scale": 1.0},
    "cohere2": {"logit_scale": 1.0},
    "muse_glimmer": {"final_logit_softcapping": 200.0, "output_multiplier": 1.0},
    "dbrx": {
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
    },
    "deepseek_v2": {"rope_scaling": {"factor": 1.0, "mscale_all_dim": 0}},
    # mlx-lm reads the pattern as text (L: local, G: global); transformers, which loads this
    # config with the tokenizer, reads it as a number unless layer_types is given.
    "exaone4": {"sliding_window_pattern": "LG", "layer_types": _SF},
    "exaone_moe": {"layer_types": _SF, "is_moe_layer": [False, True, True, True]},
    "falcon_h1": {"mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16},
    "granitemoehybrid": {
        **_GRANITE,
        "layer_types": ["mamba", "attention"] * 2,
        "mamba_n_heads": 4,
        "mamba_d_head": 32,  # transformers checks heads * head == 2 * hidden (mamba_expand)
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "shared_intermediate_size": 64,
    },
    "hunyuan": {
        "use_mixed_mlp_moe": False,
        "use_cla": False,
        "cla_share_factor": 1,
        "rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    },
    "gear": {"layer_types": _SF},
    "gemma3n": {
        "text_config": {
            "num_kv_shared_layers": 0,
            "vocab_size_per_layer_input": 512,
            "rope_local_base_freq": 10000.0,
            "final_logit_softcapping": 30.0,
            "layer_types": _SF,
            "activation_sparsity_pattern": [0.0] * 4,
            "hidden_size_per_layer_input": 16,
            "altup_num_inputs": 2,
            "altup_coef_clip": 120.0,
            "altup_correct_scale": True,
            "altup_active_idx": 0,
            "laurel_rank": 8,
        }
    },
    "gemma4": {"text_config": _GEMMA4},
    "gemma4_text": _GEMMA4,
    "glm_moe_dsa": {
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 16,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    },
    "granite": _GRANITE,
    "granitemoe": _GRANITE,
    "jamba": {
        "attn_layer_offset": 1,
        "attn_layer_period": 2,
        "expert_layer_offset": 1,
        "expert_layer_period": 2,
    },
    "kimi_linear": {"linear_attn_config": _KDA},
    "kimi_k3": {
        "text_config": {
            "linear_attn_config": _KDA,
            "num_experts_per_token": 2,
            "num_shared_experts": 1,
            "moe_intermediate_size": 64,
        }
    },
    "lfm2": _LFM2,
    "lfm2-vl": {"text_config": _LFM2},
    "lfm2_moe": {
        "use_expert_bias": True,
        "num_dense_layers": 1,
        "conv_L_cache": 3,
        "full_attn_idxs": [1, 3],
    },
    "llama4": {"text_config": _LLAMA4_TEXT},
    "llama4_text": _LLAMA4_TEXT,
    "longcat_flash": {
        "attention_method": "MLA",
        "zero_expert_type": "identity",
        "zero_expert_num": 1,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
    },
    "longcat_flash_ngram": {
        "zero_expert_num": 1,
        "mla_scale_q_lora": True,
        "mla_scale_kv_lora": True,
    },
    "mamba2": {"head_dim": 32, "time_step_limit": [0.0, 1e9]},
    "mellum": {"layer_types": _SF, "rope_parameters": _PER_LAYER_ROPE},
    "mimo_v2_flash": {
        "hybrid_layer_pattern": [1, 0, 1, 0],
        "moe_layer_freq": [0, 1, 1, 1],
        "add_swa_attention_sink_bias": False,
        "add_full_attention_sink_bias": False,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "swa_rope_theta": 10000.0,
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 2,
        "swa_head_dim": 16,
        "swa_v_head_dim": 16,
    },
    "minicpm": {"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 1.0},
    "minicpm3": {
        "dim_model_base": 64,
        "scale_depth": 1.4,
        "scale_emb": 1.0,
        "rope_scaling": {"original_max_position_embeddings": 2048},
    },
    "minimax": {"shared_intermediate_size": 64},
    "ministral3": _MISTRAL_ROPE,
    "mistral4": _MISTRAL_ROPE,
    "nemotron": {"hidden_act": "relu2"},
    "nemotron-nas": {
        "block_configs": [
            {"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"replace_with_linear": True}, "ffn": {"ffn_mult": 1.0}},
            {"attention": {"n_heads_in_group": 2}, "ffn": {"replace_with_linear": True}},
        ]
    },
    "nemotron_h": {"mamba_proj_bias": False, "hybrid_override_pattern": list("M*M-")},
    "olmo_hybrid": {
        "linear_allow_neg_eigval": False,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
    "openelm": {
        "ffn_dim_divisor": 8,
        "num_query_heads": [4] * 4,
        "num_kv_heads": [2] * 4,
        "ffn_multipliers": [2.0] * 4,
    },
    "phi3small": {"dense_attention_every_n_layers": 2, "gegelu_limit": 20.0},
    "plamo": {"n_shared_head": 2},
    "qwen": {"kv_channels": 16},
    "recurrent_gemma": {
        "logits_soft_cap": 30.0,
        "block_types": ["recurrent", "attention"],
    },
    "rwkv7": dict.fromkeys(
        ("a_low_rank_dim", "v_low_rank_dim", "gate_low_rank_dim", "decay_low_rank_dim"), 16
    ),
    "spark2_5": {
        "layer_types": _SF,
        "rope_parameters": _PER_LAYER_ROPE,
    },
    "step3p5": {"num_attention_groups": 2, "moe_top_k": 2},
}

_VL_WRAPPER = (
    "a vision-language wrapper whose transformers config (read with the tokenizer) validates "
    "vision and audio towers a text-only tiny build does not describe"
)

# Modules of mlx_lm.models this matrix does not build, and why.
UNBUILDABLE: Final[dict[str, str]] = {
    "bitnet": "BitLinear runs a Metal-only kernel: mlx-lm has no CPU path for it",
    "minimax_m3_vl": _VL_WRAPPER,
    "muse_spark": _VL_WRAPPER,
    "phi3small": "its forward pass crashes the process (SIGSEGV) on MLX's CPU backend",
    "olmo": "imports the ai2-olmo package, which is not a dependency",
    "prism_hadamard_qwen35": "needs a Hadamard rotation pack shipped with its quantized weights",
}
