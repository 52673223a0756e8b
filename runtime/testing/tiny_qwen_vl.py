"""Tiny random-weight Qwen2-VL and Qwen2.5-VL directories, built offline from mlx-vlm's classes.

What a real mlx-community Qwen-VL directory holds (config, weights, the tiny test tokenizer plus
the family's vision tokens, a preprocessor config mlx-vlm's Qwen processor reads, a chat
template), at dimensions small enough for a test to load in a second. Patches of 8 pixels merged
2 x 2: a 32 x 64 image is a 4 x 8 patch grid, 2 x 4 soft tokens, whose M-RoPE extent (4) differs
from its token count (8), so wrong positions show. See runtime/testing/tiny_vlms.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal, cast

from runtime.testing.tiny_models import _init_weights, build_directory, cache_root
from runtime.testing.tiny_tokenizer import (
    BOS,
    EOS,
    IM_END,
    IM_START,
    MAX_POSITION_EMBEDDINGS,
    PAD,
    SPECIAL_TOKENS,
    unprintable_ids,
    write_json,
)
from runtime.testing.tiny_vlms import _CHAT_TEMPLATE

QwenKind = Literal["qwen2_vl", "qwen2_5_vl"]
QWEN_KINDS: Final[tuple[QwenKind, ...]] = ("qwen2_vl", "qwen2_5_vl")
QWEN_FACTORY_VERSION: Final = 1
_TOKENS: Final = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _config(kind: QwenKind, vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    vision: dict[str, Any] = {
        "model_type": kind,
        "depth": 2,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if kind == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
    else:
        vision.update(
            hidden_size=32,
            intermediate_size=64,
            out_hidden_size=64,
            window_size=32,
            fullatt_block_indexes=[1],
        )
    return {
        "model_type": kind,
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "tie_word_embeddings": False,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)],
    }


def _write(kind: QwenKind, directory: Path, tok: Any, seed: int) -> None:
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import AddedToken

    suppress = unprintable_ids(tok)
    tok.add_special_tokens([AddedToken(t, special=True) for t in _TOKENS])
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: int(tok.token_to_id(t)) for t in _TOKENS}
    write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": PAD,
            "unk_token": None,
            "additional_special_tokens": [IM_START, IM_END, EOS, *_TOKENS],
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITION_EMBEDDINGS,
        },
    )
    write_json(directory / "chat_template.json", {"chat_template": _CHAT_TEMPLATE})
    config = _config(kind, int(tok.get_vocab_size()), ids)
    module = importlib.import_module(f"mlx_vlm.models.{kind}")
    model_config = module.ModelConfig.from_dict(dict(config))
    model_config.text_config = module.TextConfig.from_dict(config)
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model = module.Model(model_config)
    _init_weights(model, seed)
    head = model.language_model.lm_head.weight
    head[mx.array(suppress + sorted(ids.values()))] = 0.0
    model.language_model.lm_head.weight = head
    weights = dict(cast("list[tuple[str, Any]]", tree_flatten(model.parameters())))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
    write_json(directory / "config.json", config)
    processor = {
        "patch_size": 8,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 16 * 16,
        "max_pixels": 64 * 64,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2VLProcessor",
    }
    write_json(directory / "preprocessor_config.json", processor)
    write_json(directory / "video_preprocessor_config.json", {**processor, "fps": 2.0})


def tiny_qwen_vl_path(kind: QwenKind, seed: int = 0) -> Path:
    """The cached tiny ``kind`` directory under ``cache_root()``, built on first use."""
    if kind not in QWEN_KINDS:
        raise ValueError(f"unknown tiny Qwen-VL kind {kind!r}; expected one of {QWEN_KINDS}")
    stamp = {"factory_version": QWEN_FACTORY_VERSION, "kind": f"vlm-{kind}", "seed": seed}

    def write(tmp: Path, tok: Any) -> None:
        from tokenizers import Tokenizer

        _write(kind, tmp, Tokenizer.from_str(tok.to_str()), seed)

    name = f"vlm-{kind}-v{QWEN_FACTORY_VERSION}-seed{seed}"
    return build_directory(cache_root() / name, stamp, write)
