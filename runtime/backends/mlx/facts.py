"""Facts about a loaded mlx-lm model that its config files state unevenly: the context window, the
tokens that end generation, the cache layout and what reuse it allows, and the CPU dtype fix-up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from runtime.backends.contract import ModelInfo, ReuseStrategy
from runtime.backends.mlx.cache_kinds import kind_of
from runtime.errors import ModelLoadFailed

_DEFAULT_CONTEXT = 4096  # when a config declares no window at all


# End-of-turn markers of common chat templates: generation must stop on them too.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def widen_half_quantized(model: Any) -> bool:
    """Cast a quantized model's float16/bfloat16 parameters to float32; whether it did.

    Measured on SmolLM2 (MLX 0.32 CPU): a 16-token forward took 58.6 s with float16 scales and
    1.44 s with float32 ones, the dequantized weights being identical.
    """
    from mlx.utils import tree_flatten, tree_unflatten

    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    half = (mx.float16, mx.bfloat16)
    quantized = any(name.endswith(".scales") and p.dtype in half for name, p in params)
    if not quantized:
        return False
    model.update(tree_unflatten([(n, p.astype(mx.float32)) for n, p in params if p.dtype in half]))
    return True


def context_length_of(config: dict[str, Any]) -> int:
    """The context window a config declares, also where it nests it (``text_config``)."""
    for scope in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length"):
            if scope.get(key):
                return int(scope[key])
    return _DEFAULT_CONTEXT


def vocab_size_of(config: dict[str, Any]) -> int:
    """The vocabulary a config declares, also where a vision-language wrapper nests it
    (``text_config``: Qwen2-VL, Qwen3.5, Pixtral, Llama 4...); 0 when none does."""
    for scope in (config, config.get("text_config") or {}):
        if scope.get("vocab_size"):
            return int(scope["vocab_size"])
    return 0


def effective_eos_ids(tokenizer: Any, path: Path, config: dict[str, Any]) -> frozenset[int]:
    """The tokenizer's EOS, plus generation_config.json's, plus the chat template's turn end.

    mlx-lm reads only config.json; a chat model that ends turns with another token would otherwise
    run on past its answer. Raises ``ModelLoadFailed`` when generation_config.json is not JSON.
    """
    ids = {int(t) for t in tokenizer.eos_token_ids}
    ids.update(_as_ids(config.get("eos_token_id")))
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        ids.update(_as_ids(_json_object(generation_config).get("eos_token_id")))
    if getattr(tokenizer, "chat_template", None):
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in _TURN_END_TOKENS if t in vocab)
    return frozenset(ids)


def _json_object(path: Path) -> dict[str, Any]:
    """A model file holding one JSON object; raises ``ModelLoadFailed`` naming the file."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ModelLoadFailed(f"{path} is not readable JSON ({exc}); fix or delete it") from exc
    if not isinstance(found, dict):
        raise ModelLoadFailed(f"{path} must hold a JSON object; fix or delete it")
    return found


def _as_ids(value: object) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int)}
    return set()


def quantization_group(model: Any) -> int:
    """MLX quantizes in groups along the head dimension: 64 where it divides, else 32."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None and args is not None:
        hidden, heads = getattr(args, "hidden_size", 0), getattr(args, "num_attention_heads", 1)
        head_dim = hidden // max(1, heads)
    return 64 if not head_dim or head_dim % 64 == 0 else 32


def reuse_strategy(caches: list[Any]) -> tuple[ReuseStrategy, str]:
    """Which reuse path a state's layers allow, and why: trim where every layer is cut back, else
    checkpoints (copies of the layers that are not, the others cut back from their source)."""
    kinds: dict[str, list[int]] = {}
    cut_back: dict[str, bool] = {}
    for index, layer in enumerate(caches):
        kind = kind_of(layer)
        described = kind.describe(layer)
        kinds.setdefault(described, []).append(index)
        cut_back[described] = kind.cut_back(layer)
    others = {k: v for k, v in kinds.items() if not cut_back[k]}
    if not others:
        names = ", ".join(sorted(kinds))
        return ReuseStrategy.TRIM, f"every layer is a trimmable {names}: trim to the common prefix"
    described = "; ".join(f"layers {v} are {k}" for k, v in sorted(others.items()))
    if len(others) == len(kinds):
        return (
            ReuseStrategy.CHECKPOINT,
            f"{described}: no layer can be trimmed safely, so reuse restores whole checkpoints",
        )
    return (
        ReuseStrategy.CHECKPOINT,
        f"{described}: such layers cannot be trimmed safely, so checkpoints snapshot only them "
        "and cut the full-attention layers back from the state they came from",
    )


def loading_info() -> ModelInfo:
    """What a backend holds before its first pass has measured the model."""
    return ModelInfo(
        context_length=1,
        vocab_size=0,
        eos_token_ids=frozenset(),
        reuse=ReuseStrategy.NONE,
        reuse_reason="loading",
        bytes_per_token=0,
    )
