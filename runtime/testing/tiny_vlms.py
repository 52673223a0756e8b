"""Tiny random-weight vision-language models, built offline from mlx-vlm's own model classes.

Three families: ``gemma3`` (SigLIP tower, pooled soft tokens, sliding-window text layers),
``idefics3`` (SmolVLM's layout: pixel-shuffled SigLIP features, a llama-like text model) and
``smolvlm`` (SmolVLM2's, whose processor declares ``video_sampling``). Each directory holds what a
real mlx-community VLM directory holds (config, weights, the tiny test tokenizer plus the family's
image tokens, preprocessor and processor configs, a chat template), so mlx-vlm's loader and
processor read it as a real one. Cached under ``cache_root()``, rebuilt when ``VLM_FACTORY_VERSION``
changes. Needs ``[vision]``. See docs/design.md, "Testing tools".
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

TinyVlmKind = Literal["gemma3", "idefics3", "smolvlm"]
TINY_VLM_KINDS: Final[tuple[TinyVlmKind, ...]] = ("gemma3", "idefics3", "smolvlm")
VLM_FACTORY_VERSION: Final = 3  # 3: two vision encoder layers (a stop check between)
IMAGE_SIZE: Final = 32  # pixels a side the processors resize to: 4 x 4 patches of 8
# Each family's added tokens, after the tiny BPE's 512 ids, in this order.
_IMAGE_TOKENS: Final[dict[str, tuple[str, ...]]] = {
    "gemma3": ("<start_of_image>", "<end_of_image>", "<image_soft_token>"),
    "idefics3": ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"),
    "smolvlm": ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"),
}
# SmolVLM2's video sampling, as its preprocessor_config.json states it: frames a second, the most
# frames, and the size frames are resized to (one tile each, no splitting).
VIDEO_SAMPLING: Final = {"fps": 1, "max_frames": 8, "video_size": {"longest_edge": IMAGE_SIZE}}
# Content may be a string or a list of parts (what VLM templates receive); images never reach
# it as parts here: the runtime puts its own markers into the text (runtime/backends/vision/).
_CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _text_config(kind: TinyVlmKind, vocab: int) -> dict[str, Any]:
    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": vocab,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-6,
    }
    if kind == "gemma3":
        return {
            **common,
            "model_type": "gemma3_text",
            "sliding_window": 64,
            "sliding_window_pattern": 2,  # S, F, S, F
            "query_pre_attn_scalar": 16,
            "mm_tokens_per_image": 16,
        }
    return {**common, "model_type": "llama", "rope_theta": 10000.0}


def tiny_vlm_config(kind: TinyVlmKind, vocab: int, token_ids: dict[str, int]) -> dict[str, Any]:
    """The config.json of ``kind`` for a tokenizer of ``vocab`` ids (``token_ids``: the added
    image tokens' ids)."""
    vision = {
        "num_hidden_layers": 2,  # the tower's stop check between layers is tested
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 8,
        "image_size": IMAGE_SIZE,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }
    eos = [SPECIAL_TOKENS.index(IM_END), SPECIAL_TOKENS.index(EOS)]
    if kind == "gemma3":
        return {
            "model_type": "gemma3",
            "architectures": ["Gemma3ForConditionalGeneration"],
            "text_config": _text_config(kind, vocab),
            "vision_config": {**vision, "model_type": "siglip_vision_model"},
            "image_token_index": token_ids["<image_soft_token>"],
            "boi_token_index": token_ids["<start_of_image>"],
            "eoi_token_index": token_ids["<end_of_image>"],
            "mm_tokens_per_image": 16,
            "hidden_size": 64,
            "vocab_size": vocab,
            "pad_token_id": SPECIAL_TOKENS.index(PAD),
            "eos_token_id": eos,
        }
    return {
        "model_type": kind,
        "architectures": [
            "SmolVLMForConditionalGeneration"
            if kind == "smolvlm"
            else "Idefics3ForConditionalGeneration"
        ],
        "text_config": _text_config(kind, vocab),
        "vision_config": {**vision, "model_type": f"{kind}_vision"},
        "scale_factor": 2,  # 16 patches pixel-shuffled into 4 soft tokens a tile
        "image_token_id": token_ids["<image>"],
        "vocab_size": vocab,
        "eos_token_id": eos,
    }


def _processor_files(kind: TinyVlmKind) -> tuple[dict[str, Any], dict[str, Any]]:
    """``preprocessor_config.json`` and ``processor_config.json``."""
    common = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255,
        "resample": 2,
    }
    if kind == "gemma3":
        image = {
            **common,
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": "Gemma3Processor",
            "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
            "do_pan_and_scan": False,
        }
        return image, {"processor_class": "Gemma3Processor", "image_seq_length": 16}
    name = "SmolVLM" if kind == "smolvlm" else "Idefics3"
    image = {
        **common,
        "image_processor_type": f"{name}ImageProcessor",
        "processor_class": f"{name}Processor",
        "size": {"longest_edge": 2 * IMAGE_SIZE},
        "max_image_size": {"longest_edge": IMAGE_SIZE},
        "do_image_splitting": True,  # up to 2 x 2 tiles and a global view
        "do_pad": True,
    }
    if kind == "smolvlm":
        image["video_sampling"] = VIDEO_SAMPLING
    return image, {"processor_class": f"{name}Processor", "image_seq_len": 4}


def _write_tokenizer(kind: TinyVlmKind, directory: Path, tok: Any) -> dict[str, int]:
    """The tiny BPE plus the family's image tokens; their ids."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True) for t in _IMAGE_TOKENS[kind]])
    tok.save(str(directory / "tokenizer.json"))
    ids = {t: int(tok.token_to_id(t)) for t in _IMAGE_TOKENS[kind]}
    extra: dict[str, Any] = {}
    if kind == "gemma3":
        extra["extra_special_tokens"] = {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END, EOS, *_IMAGE_TOKENS[kind]],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        **extra,
    }
    write_json(directory / "tokenizer_config.json", config)
    # Only the processor's file holds the template, as in many real VLM directories.
    write_json(directory / "chat_template.json", {"chat_template": _CHAT_TEMPLATE})
    return ids


def _write_vlm(kind: TinyVlmKind, directory: Path, tok: Any, seed: int) -> None:
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten

    suppress = unprintable_ids(tok)  # before the image tokens join the vocabulary
    ids = _write_tokenizer(kind, directory, tok)
    vocab = int(tok.get_vocab_size())
    config = tiny_vlm_config(kind, vocab, ids)
    module = importlib.import_module(f"mlx_vlm.models.{kind}")
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model = module.Model(model_config)
    _init_weights(model, seed)
    if kind == "gemma3":  # Gemma scales embeddings by sqrt(hidden): keep the residual at unit size
        embed = model.language_model.model.embed_tokens
        embed.weight = embed.weight / config["text_config"]["hidden_size"] ** 0.5
    # As for the tiny text models: special, image and unprintable tokens never win greedily.
    head = model.language_model.lm_head.weight
    head[mx.array(suppress + sorted(ids.values()))] = 0.0
    model.language_model.lm_head.weight = head
    weights = dict(cast("list[tuple[str, Any]]", tree_flatten(model.parameters())))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
    write_json(directory / "config.json", config)
    image, processor = _processor_files(kind)
    write_json(directory / "preprocessor_config.json", image)
    write_json(directory / "processor_config.json", processor)


def build_tiny_vlm(kind: TinyVlmKind, directory: Path, seed: int = 0) -> Path:
    """Write the tiny VLM ``kind`` at ``directory`` (idempotent, like ``build_tiny_model``)."""
    if kind not in TINY_VLM_KINDS:
        raise ValueError(f"unknown tiny VLM kind {kind!r}; expected one of {TINY_VLM_KINDS}")
    stamp = {"factory_version": VLM_FACTORY_VERSION, "kind": f"vlm-{kind}", "seed": seed}

    def write(tmp: Path, tok: Any) -> None:
        from tokenizers import Tokenizer

        # A copy: the shared trained tokenizer must not gain this family's image tokens.
        _write_vlm(kind, tmp, Tokenizer.from_str(tok.to_str()), seed)

    return build_directory(Path(directory), stamp, write)


def tiny_vlm_path(kind: TinyVlmKind, seed: int = 0) -> Path:
    """The cached tiny VLM ``kind`` under ``cache_root()``, built on first use."""
    name = f"vlm-{kind}-v{VLM_FACTORY_VERSION}-seed{seed}"
    return build_tiny_vlm(kind, cache_root() / name, seed)
