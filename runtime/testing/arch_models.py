"""Tiny random-weight builds of every architecture mlx-lm ships, for the architecture matrix.

``tiny_models`` writes three kinds by hand; this derives a tiny config from any
``mlx_lm.models.<arch>.ModelArgs``, so the matrix (tests/test_architectures.py) covers every module
of the installed mlx-lm. One generic config keeps the fields each ``ModelArgs`` declares;
``OVERRIDES`` adds what an architecture needs beyond it and ``UNBUILDABLE`` lists, with the reason,
what cannot be built. Weights are random (fixed seed), scaled so greedy output depends on the
prompt, with special tokens' output rows zeroed. A test that counts on a size passes it as
``overrides`` to ``arch_model_path``. See docs/design.md, "Testing tools".
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib
import json
import math
import re
from pathlib import Path
from typing import Any, Final, cast

from runtime.testing.arch_table import OVERRIDES, UNBUILDABLE
from runtime.testing.tiny_models import build_directory, cache_root
from runtime.testing.tiny_tokenizer import (
    BOS,
    EOS,
    IM_END,
    MAX_POSITION_EMBEDDINGS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    unprintable_ids,
)

__all__ = [
    "ARCH_FACTORY_VERSION",
    "OVERRIDES",
    "UNBUILDABLE",
    "arch_config",
    "arch_model_path",
    "buildable_architectures",
    "mlx_lm_architectures",
]

# Part of each build's stamp: bump on any change to what gets written.
ARCH_FACTORY_VERSION: Final = 2
WINDOW: Final = 32
HIDDEN: Final = 64
LAYERS: Final = 4
_EOS_IDS: Final = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)]

# Values for the fields most ModelArgs share, under each name architectures use for them. Only
# the fields an architecture's ModelArgs declares are written (nested configs take them all).
GENERIC: Final[dict[str, Any]] = {
    # shape
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "model_dim"), HIDDEN),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers"), LAYERS),
    **dict.fromkeys(("num_transformer_layers",), LAYERS),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads"), 2),
    **dict.fromkeys(
        ("intermediate_size", "n_inner", "ffn_hidden_size", "ff_intermediate_size"), 128
    ),
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    **dict.fromkeys(
        ("max_position_embeddings", "n_positions", "n_ctx", "block_size", "model_max_length"),
        MAX_POSITION_EMBEDDINGS,
    ),
    **dict.fromkeys(("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon"), 1e-5),
    **dict.fromkeys(("layernorm_epsilon",), 1e-5),
    **dict.fromkeys(("rope_theta", "rotary_emb_base"), 10000.0),
    "tie_word_embeddings": False,
    **dict.fromkeys(("attention_bias", "mlp_bias", "use_bias", "use_qkv_bias", "bias"), False),
    **dict.fromkeys(("use_conv_bias", "conv_bias", "qkv_bias"), False),
    "use_qk_norm": False,
    "rope_scaling": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    # mixture of experts: 4 experts, 2 active, the first layer dense where that is an option
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    **dict.fromkeys(("moe_num_experts",), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_ffn_hidden_size"), 64),
    **dict.fromkeys(("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"), 64),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "num_shared_expert"), 1),
    "first_k_dense_replace": 1,
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_layer_freq": 1,
    # multi-head latent attention
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 32),
    "qk_rope_head_dim": 8,
    **dict.fromkeys(("qk_nope_head_dim", "v_head_dim"), 16),
    # sliding windows: layer i slides unless (i + 1) % pattern == 0
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size"), WINDOW),
    "sliding_window_pattern": 2,
    # state-space / linear-attention layers
    **dict.fromkeys(("state_size", "ssm_state_size", "mamba_d_state"), 16),
    **dict.fromkeys(("conv_kernel", "mamba_d_conv", "linear_conv_kernel_dim", "conv1d_width"), 4),
    **dict.fromkeys(("n_groups", "mamba_n_groups"), 1),
    "mamba_expand": 2,
    "time_step_rank": 8,
    **dict.fromkeys(("mamba_num_heads", "mamba_n_heads"), 4),
    **dict.fromkeys(("mamba_head_dim", "mamba_d_head"), 16),
    **dict.fromkeys(("linear_num_value_heads", "linear_num_key_heads"), 2),
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim"), 16),
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.5,
    "rotary_dim": 8,
    # ids
    "eos_token_id": _EOS_IDS,
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "pad_token_id": SPECIAL_TOKENS.index("<pad>"),
}


# ``class Model(`` or a re-export (solar_open takes glm4_moe's ``Model``).
_DEFINES_MODEL: Final = re.compile(r"^(class Model\(|from \S+ import .*\bModel\b)", re.MULTILINE)


def mlx_lm_architectures() -> list[str]:
    """Every module of the installed ``mlx_lm.models`` that defines ``Model`` and ``ModelArgs``
    (read from the source, so a module that fails to import is still listed)."""
    import mlx_lm.models

    root = Path(mlx_lm.models.__file__).parent
    found = []
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "\nclass ModelArgs(" in text and _DEFINES_MODEL.search(text):
            found.append(path.stem)
    return found


def buildable_architectures() -> list[str]:
    """``mlx_lm_architectures()`` less ``UNBUILDABLE``."""
    return [arch for arch in mlx_lm_architectures() if arch not in UNBUILDABLE]


def _arg_fields(args_cls: Any) -> set[str]:
    return {field.name for field in dataclasses.fields(args_cls)}


def arch_config(arch: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json content for ``arch``: the generic values its ModelArgs declares, nested
    configs (``text_config``...) given every generic value, then ``OVERRIDES[arch]``, then
    ``overrides`` (a test's own sizes: a dict value is merged into a nested config)."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    fields = _arg_fields(module.ModelArgs)
    config: dict[str, Any] = {k: copy.deepcopy(v) for k, v in GENERIC.items() if k in fields}
    for nested in ("text_config", "llm_config", "language_config"):
        if nested in fields:
            config[nested] = {**copy.deepcopy(GENERIC), "model_type": arch}
    config["model_type"] = arch
    config["eos_token_id"] = _EOS_IDS
    config["torch_dtype"] = "float32"
    for extra in (OVERRIDES.get(arch, {}), overrides or {}):
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **copy.deepcopy(value)}
            else:
                config[key] = copy.deepcopy(value)
    return config


# ----------------------------------------------------------------------------- weights


def _init_weights(model: Any, seed: int, suppress: list[int]) -> None:
    """Re-draw every float parameter from explicit keys derived from ``seed`` (float32).

    As in ``tiny_models``: unit-variance embeddings and N(0, 1.5^2 / fan_in) projections give
    attention and recurrence real influence (mlx's default init lets the current token's
    embedding decide). The output rows of ``suppress`` are zeroed (in the head, or scaled to
    near zero in a tied embedding, whose rows are also inputs: a zero input row turns norms
    into NaN), so those tokens' logits are ~0 while printable ones draw random +-logits and
    greedy never picks them.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    params = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), max(len(params), 1))
    drawn = [
        (name, _draw(name, value, key) if mx.issubdtype(value.dtype, mx.floating) else value)
        for (name, value), key in zip(params, keys, strict=False)
    ]
    heads = [n for n, v in drawn if _is_vocab_matrix(v) and not _is_embedding(n)]
    rows = mx.array(suppress)
    for index, (name, value) in enumerate(drawn):
        if _is_vocab_matrix(value) and (name in heads or (not heads and _is_embedding(name))):
            value[rows] = 0.0 if heads else value[rows] * 1e-3
            drawn[index] = (name, value)
    model.update(tree_unflatten(drawn))
    mx.eval(model.parameters())


def _is_vocab_matrix(value: Any) -> bool:
    return len(value.shape) == 2 and value.shape[0] == VOCAB_SIZE


def _is_embedding(name: str) -> bool:
    return "embed" in name or "wte" in name or name.endswith("emb.weight")


def _draw(name: str, value: Any, key: Any) -> Any:
    import mlx.core as mx

    f32, shape = mx.float32, tuple(value.shape)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":  # state decay, drawn like mlx-lm's own SSM inits
        return mx.log(mx.random.uniform(1.0, 16.0, shape, f32, key=key))
    if len(shape) < 2 or math.prod(shape) == max(shape):
        # Norm weights, biases, per-channel gains and mixes: the module's own init, in float32.
        return value.astype(f32)
    if "conv" in name and len(shape) == 3:  # (out, kernel, in): fan_in is kernel * in
        bound = 1.0 / (shape[1] * shape[2]) ** 0.5
        return mx.random.uniform(-bound, bound, shape, f32, key=key)
    if _is_vocab_matrix(value) and _is_embedding(name):
        return mx.random.normal(shape, f32, key=key)
    return (1.5 / shape[-1] ** 0.5) * mx.random.normal(shape, f32, key=key)


def _write_model(
    arch: str, config: dict[str, Any], directory: Path, seed: int, tokenizer: Any
) -> None:
    from mlx_lm.utils import save_config, save_model

    module = importlib.import_module(f"mlx_lm.models.{arch}")
    model = module.Model(module.ModelArgs.from_dict(config))
    _init_weights(model, seed, unprintable_ids(tokenizer))
    save_model(directory, model)
    save_config(config, config_path=directory / "config.json")


def arch_model_path(arch: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> Path:
    """The tiny build of ``arch`` under ``cache_root()/arch``, built on first use (atomically,
    as ``tiny_models.build_tiny_model``); raises ``ValueError`` for an ``UNBUILDABLE`` one.

    ``overrides`` are config fields merged over the generic tiny config (``arch_config``), for a
    test that depends on a size (a KV head count, a chunk, SSM heads); such a build gets its own
    directory, named by a digest of the overrides, so it never replaces the generic one.
    """
    if arch in UNBUILDABLE:
        raise ValueError(f"{arch} cannot be built: {UNBUILDABLE[arch]}")
    import mlx_lm

    # The config's digest and mlx-lm's version are part of the stamp: a changed override or a
    # new mlx-lm rebuilds instead of reusing a stale directory.
    config = arch_config(arch, overrides)
    text = json.dumps(config, sort_keys=True)
    stamp = {
        "arch_factory_version": ARCH_FACTORY_VERSION,
        "arch": arch,
        "seed": seed,
        "mlx_lm": mlx_lm.__version__,
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    name = f"{arch}-v{ARCH_FACTORY_VERSION}-seed{seed}"
    if overrides:
        digest = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()
        name = f"{arch}-{digest[:12]}-v{ARCH_FACTORY_VERSION}-seed{seed}"
    return build_directory(
        cache_root() / "arch" / name,
        stamp,
        lambda tmp, tok: _write_model(arch, config, tmp, seed, tok),
    )
