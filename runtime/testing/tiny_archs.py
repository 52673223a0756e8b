"""Tiny random-weight builds of the architectures whose batching mlx-lm gets wrong.

``runtime.testing.tiny_models`` builds the three cache kinds the runtime is proven on; this module
builds the ones where mlx-lm's batched passes have defects the backend works around or the load
probe switches off (docs/models.md, "Upstream defects and workarounds"): mamba2 and nemotron_h
(SSM layers whose batched state read is wrong on a cut pass), rwkv7 (a recurrence that takes no
padding mask) and gemma2 (attention that cannot take a per-row mask). Same tokenizer, same weight
init and the same special-token suppression as the tiny models, so greedy output is prompt-
dependent text that never stops on EOS. Two layers, hidden 64: a load costs well under a second.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Final, Literal, get_args

import mlx.core as mx

from runtime.testing.tiny_models import _init_weights, _install, cache_root
from runtime.testing.tiny_tokenizer import (
    BOS,
    EOS,
    IM_END,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    train_tiny_tokenizer,
    unprintable_ids,
    write_json,
    write_tokenizer,
)

TinyArch = Literal["mamba2", "nemotron_h", "rwkv7", "gemma2"]
TINY_ARCHS: Final[tuple[TinyArch, ...]] = get_args(TinyArch)
ARCH_FACTORY_VERSION: Final = 1
_STAMP: Final = "tiny_arch_stamp.json"
_HIDDEN: Final = 64


def tiny_arch_config(arch: TinyArch) -> dict[str, Any]:
    """config.json for a two-layer, hidden-64 build of ``arch``."""
    common: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": _HIDDEN,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)],
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "torch_dtype": "float32",
    }
    ssm = {
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 1,
        "use_bias": False,
        "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, 1e9],
    }
    if arch == "mamba2":
        extra = {
            **ssm,
            "num_heads": 8,
            "head_dim": 16,
            "intermediate_size": 128,
            "state_size": 16,
            "num_hidden_layers": 2,
            "time_step_rank": "auto",
        }
    elif arch == "nemotron_h":
        extra = {
            **ssm,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "attention_bias": False,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "mlp_bias": False,
            "hybrid_override_pattern": ["M", "*", "M", "-"],
            "num_hidden_layers": 4,
        }
    elif arch == "rwkv7":
        extra = {
            "intermediate_size": 128,
            "norm_eps": 1e-5,
            "head_dim": 16,
            "num_hidden_layers": 2,
            "a_low_rank_dim": 16,
            "v_low_rank_dim": 16,
            "gate_low_rank_dim": 16,
            "decay_low_rank_dim": 16,
        }
    else:
        extra = {
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,  # GQA: the per-row mask meets a 5-d score tensor
            "head_dim": 16,
            "rms_norm_eps": 1e-6,
            "query_pre_attn_scalar": 16,
        }
    return {**common, **extra}


def build_tiny_arch(arch: TinyArch, directory: Path, seed: int = 0) -> Path:
    """Write an mlx-lm model directory of ``arch`` at ``directory`` (kept if already built); built
    aside and renamed into place, like ``tiny_models.build_tiny_model``."""
    from mlx_lm.utils import save_config, save_model

    config = tiny_arch_config(arch)
    stamp = {"version": ARCH_FACTORY_VERSION, "seed": seed, "config": config}
    if _stamped(directory, stamp):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        os.chmod(tmp, 0o755)
        tokenizer = train_tiny_tokenizer()
        write_tokenizer(tmp, tokenizer)
        module = importlib.import_module(f"mlx_lm.models.{arch}")
        model = module.Model(module.ModelArgs.from_dict(config))
        _init_weights(model, seed)
        # gemma2 ties its output to the embedding: zeroing the rows there mutes those tokens'
        # inputs too, which no test prompt uses.
        head = model.lm_head if "lm_head" in model else model.model.embed_tokens
        weight = head.weight
        weight[mx.array(unprintable_ids(tokenizer))] = 0.0  # never a greedy draw
        head.weight = weight
        save_model(tmp, model)
        save_config(config, config_path=tmp / "config.json")
        write_json(tmp / _STAMP, stamp)  # last: its presence means the rest is complete
        _install(tmp, directory, lambda: _stamped(directory, stamp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def tiny_arch_path(arch: TinyArch, seed: int = 0) -> Path:
    """``arch``'s build under the tiny models' cache root (built on first use)."""
    return build_tiny_arch(arch, cache_root() / f"{arch}-arch-v{ARCH_FACTORY_VERSION}-seed{seed}")


def _stamped(directory: Path, stamp: dict[str, Any]) -> bool:
    try:
        return bool(json.loads((directory / _STAMP).read_text()) == stamp)
    except (OSError, ValueError):
        return False
