"""Per-architecture knowledge: GGUF metadata -> mlx-lm ``config.json``, tensor names, and the
conventions llama.cpp applies when it writes a file (each undone here, each proven by a test).

- llama: llama.cpp permutes the rows of Q and K for its RoPE layout (pairs interleaved); mlx-lm
  rotates halves, so the rows are permuted back per head.
- gemma3: llama.cpp stores every RMSNorm weight as ``1 + w``; mlx-lm's Gemma norm adds the 1
  itself, so 1 is subtracted. The file lacks config Gemma 3 needs (local RoPE base, the 5:1
  sliding pattern, the query scale): those are Gemma 3's published values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import UnsupportedModelFormat

Metadata = Mapping[str, Any]

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
}


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture becomes an mlx-lm model directory."""

    name: str
    layer_names: Mapping[str, str]  # GGUF ``blk.N.<key>`` -> mlx-lm ``model.layers.N.<value>``
    config: Callable[[Metadata, bool], dict[str, Any]]  # (metadata, has untied output) -> config
    fix: Callable[[str, np.ndarray, Metadata], np.ndarray]  # undo llama.cpp conventions (float)
    fix_rows: Callable[[str, Metadata], np.ndarray | None]  # a row order to apply, for any format

    def mlx_name(self, gguf_name: str) -> str:
        """The mlx-lm parameter name of a GGUF tensor; raises ``UnsupportedModelFormat``."""
        if gguf_name in _TOP_LEVEL:
            return _TOP_LEVEL[gguf_name]
        parts = gguf_name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}.{parts[3]}"
        raise UnsupportedModelFormat(
            f"the GGUF tensor {gguf_name!r} has no place in mlx-lm's {self.name} model; this "
            "file may be a variant the importer does not know"
        )


def _get(meta: Metadata, arch: str, key: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise UnsupportedModelFormat(f"the GGUF file lacks {arch}.{key}, which the model needs")
    return value


def _vocab_size(meta: Metadata, arch: str) -> int:
    return int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"]))


def _unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's Q/K permutation (per head: interleaved pairs -> halves)."""
    head_dim = n_rows // n_heads
    order = np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).swapaxes(1, 2)
    return order.reshape(n_rows)


# --------------------------------------------------------------------------- llama


def _llama_head_dim(meta: Metadata) -> int:
    heads = int(_get(meta, "llama", "attention.head_count"))
    hidden = int(_get(meta, "llama", "embedding_length"))
    return int(meta.get("llama.attention.key_length") or hidden // heads)


def _llama_config(meta: Metadata, untied: bool) -> dict[str, Any]:
    a = "llama"
    if meta.get(f"{a}.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelFormat("llama GGUF files with RoPE scaling cannot be imported yet")
    heads = int(_get(meta, a, "attention.head_count"))
    return {
        "model_type": "llama",
        "hidden_size": int(_get(meta, a, "embedding_length")),
        "num_hidden_layers": int(_get(meta, a, "block_count")),
        "intermediate_size": int(_get(meta, a, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_get(meta, a, "attention.head_count_kv", heads)),
        "head_dim": _llama_head_dim(meta),
        "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_get(meta, a, "context_length")),
        "vocab_size": _vocab_size(meta, a),
        "tie_word_embeddings": not untied,
        "rope_traditional": False,
        "attention_bias": False,
        "mlp_bias": False,
    }


def _llama_rows(name: str, meta: Metadata) -> np.ndarray | None:
    kind = name.split(".")[2] if name.startswith("blk.") else ""
    if kind not in ("attn_q", "attn_k"):
        return None
    heads = int(meta["llama.attention.head_count"])
    if kind == "attn_k":
        heads = int(meta.get("llama.attention.head_count_kv") or heads)
    return _unpermute_rows(heads * _llama_head_dim(meta), heads)


def _no_fix(name: str, values: np.ndarray, meta: Metadata) -> np.ndarray:
    return values


LLAMA = Architecture(
    name="llama",
    layer_names={**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    config=_llama_config,
    fix=_no_fix,
    fix_rows=_llama_rows,
)

# --------------------------------------------------------------------------- gemma3

# Gemma 3's published values that llama.cpp keeps in code, not in the file.
GEMMA3_ROPE_LOCAL_BASE = 10000.0
GEMMA3_SLIDING_PATTERN = 6


def _gemma3_config(meta: Metadata, untied: bool) -> dict[str, Any]:
    a = "gemma3"
    heads = int(_get(meta, a, "attention.head_count"))
    head_dim = int(_get(meta, a, "attention.key_length"))
    return {
        "model_type": "gemma3_text",
        "hidden_size": int(_get(meta, a, "embedding_length")),
        "num_hidden_layers": int(_get(meta, a, "block_count")),
        "intermediate_size": int(_get(meta, a, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_get(meta, a, "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_get(meta, a, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": GEMMA3_ROPE_LOCAL_BASE,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(_get(meta, a, "attention.sliding_window")),
        "sliding_window_pattern": GEMMA3_SLIDING_PATTERN,
        "max_position_embeddings": int(_get(meta, a, "context_length")),
        "vocab_size": _vocab_size(meta, a),
    }


def _gemma3_fix(name: str, values: np.ndarray, meta: Metadata) -> np.ndarray:
    if name.endswith("norm.weight"):  # every norm kind: attn, ffn, post-*, q/k, output
        return values - np.float32(1.0)
    return values


GEMMA3 = Architecture(
    name="gemma3",
    layer_names={
        **_LAYER_COMMON,
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    config=_gemma3_config,
    fix=_gemma3_fix,
    fix_rows=lambda name, meta: None,
)

ARCHITECTURES: Mapping[str, Architecture] = {arch.name: arch for arch in (LLAMA, GEMMA3)}


def architecture_of(meta: Metadata) -> Architecture:
    """The importer for a file's ``general.architecture``; raises ``UnsupportedModelFormat``."""
    name = str(meta.get("general.architecture", "?"))
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedModelFormat(
            f"GGUF architecture {name!r} cannot be imported yet; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}"
        ) from None
