"""The real backend: an mlx-lm model and its per-layer caches, run on the engine's compute thread.

Loading never downloads: ``ModelSpec.path`` is a local mlx-lm model directory, or a Hugging Face
repo id that is already in the local cache. At load the backend runs one tiny forward pass, which
warms the weights and lets it measure the cache layout (bytes per token, windows, fixed recurrent
state) from real arrays instead of trusting config fields that differ between architectures.
"""

from __future__ import annotations

import copy
import gc
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from runtime.backend import (
    CannotTrim,
    DecodeBatchHandle,
    ModelInfo,
    ReuseStrategy,
    SequenceState,
    Snapshot,
)
from runtime.errors import InvalidModelSpec, ModelLoadFailed
from runtime.messages import ModelSpec
from runtime.model_source import prepare_model

_WARMUP_TOKENS = 4
_DEFAULT_CONTEXT = 4096  # when a config declares no window at all
log = logging.getLogger("mlx_actor_runtime.mlx_backend")


class MlxState:
    """A sequence's caches (one per layer), tokens consumed, and the logits after the last one."""

    __slots__ = ("caches", "logits", "n_tokens")

    def __init__(self, caches: list[Any], n_tokens: int = 0, logits: mx.array | None = None):
        self.caches = caches
        self.n_tokens = n_tokens
        self.logits = logits

    @property
    def length(self) -> int:
        return self.n_tokens


class MlxSnapshot:
    """Copies of a state's untrimmable layers (by layer index) at ``length`` tokens."""

    __slots__ = ("layers", "n_tokens", "size")

    def __init__(self, layers: dict[int, Any], n_tokens: int) -> None:
        self.layers = layers
        self.n_tokens = n_tokens
        self.size = sum(int(c.nbytes) for c in layers.values() if not c.empty())

    @property
    def length(self) -> int:
        return self.n_tokens

    @property
    def nbytes(self) -> int:
        return self.size


class MlxBackend:
    """``runtime.backend.Backend`` over mlx-lm. Every method runs on one compute thread."""

    def __init__(self, model: Any, tokenizer: Any, info: ModelInfo, kv_bits: int | None) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._info = info
        self._kv_bits = kv_bits
        self._path = Path(".")
        self._kv_group = _quantization_group(model) if kv_bits is not None else 64

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, spec: ModelSpec) -> MlxBackend:
        """Load ``spec.path``; raises ``ModelLoadFailed`` naming what is missing."""
        from mlx_lm.utils import load as mlx_load

        prepared = prepare_model(spec)
        path = prepared.path
        if prepared.note:
            log.info("model %r: %s", spec.name, prepared.note)
        kv_bits = _int_option(spec, "kv_bits")
        if kv_bits not in (None, 4, 8):
            raise InvalidModelSpec(f"kv_bits must be 4 or 8 (got {kv_bits})")
        try:
            loaded = mlx_load(str(path), return_config=True)
            model, tokenizer, config = cast(tuple[Any, Any, dict[str, Any]], loaded)
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ModelLoadFailed(f"could not load the model at {path}: {exc}") from exc
        if mx.default_device() == mx.cpu and widen_half_quantized(model):
            log.info(
                "model %r: quantized with half-precision scales; widened them (and the other "
                "half-precision weights) to float32, which MLX's CPU kernels run ~40x faster",
                spec.name,
            )
        backend = cls(model, tokenizer, _placeholder_info(), kv_bits)
        backend._path = path
        try:
            backend._info = backend._measure(spec, config)
        except (ValueError, TypeError) as exc:  # e.g. an architecture the options do not fit
            raise ModelLoadFailed(f"the model at {path} failed its warm-up pass: {exc}") from exc
        return backend

    def _measure(self, spec: ModelSpec, config: dict[str, Any]) -> ModelInfo:
        """Run a tiny forward pass and read the cache layout off the real arrays."""
        state = self.new_state()
        self.prefill(state, [0] * _WARMUP_TOKENS)
        per_token = window_per_token = fixed = 0
        window: int | None = None
        kinds: dict[str, list[int]] = {}
        for index, layer_cache in enumerate(state.caches):
            kinds.setdefault(type(layer_cache).__name__, []).append(index)
            if isinstance(layer_cache, mlx_cache.RotatingKVCache):
                window = max(window or 0, layer_cache.max_size)
                window_per_token += _kv_bytes_per_token(layer_cache)
            elif isinstance(layer_cache, (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)):
                per_token += _kv_bytes_per_token(layer_cache)
            else:
                fixed += int(layer_cache.nbytes)
        strategy, reason = _reuse_strategy(kinds, window)
        context = _int_option(spec, "context_length") or context_length_of(config)
        eos = effective_eos_ids(self._tokenizer, self._path, config)
        log.info(
            "model %r: context %d tokens, generation ends on token ids %s (%s)",
            spec.name,
            context,
            sorted(eos),
            ", ".join(repr(self._tokenizer.decode([t])) for t in sorted(eos)),
        )
        return ModelInfo(
            context_length=context,
            vocab_size=int(config.get("vocab_size", 0)),
            eos_token_ids=eos,
            reuse=strategy,
            reuse_reason=reason,
            bytes_per_token=per_token,
            window_tokens=window,
            window_bytes_per_token=window_per_token,
            fixed_state_bytes=fixed,
            alloc_step=mlx_cache.KVCache.step,
        )

    @property
    def info(self) -> ModelInfo:
        return self._info

    # ------------------------------------------------------------------ tokens

    @property
    def chat_tokenizer(self) -> Any:
        return self._tokenizer  # mlx-lm's wrapper: encode() and the model's chat template

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids)))

    # ------------------------------------------------------------------ states

    def new_state(self) -> MlxState:
        caches = mlx_cache.make_prompt_cache(self._model)
        if self._kv_bits is not None:
            caches = [
                mlx_cache.QuantizedKVCache(group_size=self._kv_group, bits=self._kv_bits)
                if type(c) is mlx_cache.KVCache
                else c
                for c in caches
            ]
        return MlxState(caches)

    def can_trim(self, state: SequenceState) -> bool:
        """Whether every layer of ``state`` can be cut back (a rotating cache until it wraps)."""
        return all(c.is_trimmable() for c in _own(state).caches)

    def copy_state(
        self, state: SequenceState, length: int, snapshot: Snapshot | None = None
    ) -> MlxState:
        source = _own(state)
        if not 0 <= length <= source.n_tokens:
            raise CannotTrim(f"cannot copy {length} tokens of a {source.n_tokens}-token state")
        drop = source.n_tokens - length
        logits = source.logits if drop == 0 else None
        if snapshot is not None:
            if not isinstance(snapshot, MlxSnapshot) or snapshot.n_tokens != length:
                raise CannotTrim(f"the snapshot does not hold {length} tokens of this state")
            caches = [
                _copy_layer(snapshot.layers[i], 0) if i in snapshot.layers else _copy_layer(c, drop)
                for i, c in enumerate(source.caches)
            ]
            return MlxState(caches, length, logits)
        if drop and not self.can_trim(source):
            raise CannotTrim(
                "a layer of this cache cannot be trimmed (sliding window or recurrent)"
            )
        return MlxState([_copy_layer(c, drop) for c in source.caches], length, logits)

    def snapshot(self, state: SequenceState) -> MlxSnapshot:
        """Copy the sliding-window and recurrent layers; full-attention KV is trimmed later."""
        source = _own(state)
        layers = {
            i: _snapshot_layer(c)
            for i, c in enumerate(source.caches)
            if type(c) not in _TRIMMABLE_LAYERS
        }
        mx.eval([c.state for c in layers.values() if not c.empty()])
        return MlxSnapshot(layers, source.n_tokens)

    def prefill(self, state: SequenceState, token_ids: Sequence[int]) -> None:
        own = _own(state)
        if not token_ids:
            return
        logits = self._model(mx.array([list(token_ids)]), cache=own.caches)
        own.logits = logits[0, -1].astype(mx.float32)
        mx.eval(own.logits, [c.state for c in own.caches])
        own.n_tokens += len(token_ids)

    def logits(self, state: SequenceState) -> mx.array:
        own = _own(state)
        if own.logits is None:
            raise RuntimeError("logits() before any prefill")
        return own.logits

    def open_batch(self) -> DecodeBatchHandle | None:
        from runtime.mlx_batch import DecodeBatch

        return DecodeBatch(self) if DecodeBatch.supports(self) else None

    def state_nbytes(self, state: SequenceState) -> int:
        return sum(int(c.nbytes) for c in _own(state).caches if not c.empty())

    def close(self) -> None:
        """Drop the model and return MLX's cached buffers to the system.

        The thread's MLX streams are left alone: the thread's owner clears them before the
        thread exits (``runtime.actor.release_thread_resources``).
        """
        self._model = None
        self._tokenizer = None
        gc.collect()
        mx.clear_cache()


# ---------------------------------------------------------------------- helpers


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


def effective_eos_ids(tokenizer: Any, path: Path, config: dict[str, Any]) -> frozenset[int]:
    """The tokenizer's EOS, plus generation_config.json's, plus the chat template's turn end.

    mlx-lm reads only config.json; a chat model that ends turns with another token would otherwise
    run on past its answer.
    """
    ids = {int(t) for t in tokenizer.eos_token_ids}
    ids.update(_as_ids(config.get("eos_token_id")))
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        ids.update(_as_ids(json.loads(generation_config.read_text()).get("eos_token_id")))
    if getattr(tokenizer, "chat_template", None):
        vocab = tokenizer.get_vocab()
        ids.update(vocab[t] for t in _TURN_END_TOKENS if t in vocab)
    return frozenset(ids)


def _as_ids(value: object) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int)}
    return set()


def _int_option(spec: ModelSpec, name: str) -> int | None:
    value = spec.options.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidModelSpec(f"option {name!r} must be an integer (got {value!r})")
    return value


def _quantization_group(model: Any) -> int:
    """MLX quantizes in groups along the head dimension: 64 where it divides, else 32."""
    args = getattr(model, "args", None)
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None and args is not None:
        hidden, heads = getattr(args, "hidden_size", 0), getattr(args, "num_attention_heads", 1)
        head_dim = hidden // max(1, heads)
    return 64 if not head_dim or head_dim % 64 == 0 else 32


def _placeholder_info() -> ModelInfo:
    return ModelInfo(
        context_length=1,
        vocab_size=0,
        eos_token_ids=frozenset(),
        reuse=ReuseStrategy.NONE,
        reuse_reason="loading",
        bytes_per_token=0,
    )


def _kv_bytes_per_token(layer_cache: Any) -> int:
    """Bytes one token adds to a KV layer: keys plus values, across heads (quantized or not)."""
    keys, values = layer_cache.keys, layer_cache.values
    parts = [*keys, *values] if isinstance(keys, tuple) else [keys, values]
    return sum(int(a.nbytes) // int(a.shape[2]) for a in parts)


# Layers that can always be cut back to a shorter prefix (a rotating cache only until it wraps).
_TRIMMABLE_LAYERS = (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def _reuse_strategy(kinds: dict[str, list[int]], window: int | None) -> tuple[ReuseStrategy, str]:
    trimmable = {kind.__name__ for kind in _TRIMMABLE_LAYERS}
    others = {k: v for k, v in kinds.items() if k not in trimmable}
    if not others:
        names = ", ".join(sorted(kinds))
        return ReuseStrategy.TRIM, f"every layer is a trimmable {names}: trim to the common prefix"
    described = "; ".join(
        f"layers {v} are {k}" + (f" (window {window})" if k == "RotatingKVCache" else "")
        for k, v in sorted(others.items())
    )
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


def _copy_layer(layer_cache: Any, drop: int) -> Any:
    """An independent copy of one layer's cache minus its last ``drop`` tokens.

    New array objects are made by slicing, so in-place cache updates of the copy never reach the
    original (prefix entries are shared and must not change).
    """
    clone = copy.copy(layer_cache)
    if isinstance(layer_cache, mlx_cache.RotatingKVCache):
        keys, values = layer_cache.keys, layer_cache.values
        if keys is not None and values is not None:
            if drop == 0:  # possibly wrapped around: copy the whole ring
                clone.keys, clone.values = mx.array(keys), mx.array(values)
            else:  # trimmable means not wrapped: tokens sit in order before _idx
                end = layer_cache._idx - drop
                clone.keys, clone.values = keys[..., :end, :], values[..., :end, :]
        clone.offset = layer_cache.offset - drop
        clone._idx = layer_cache._idx - drop
        return clone
    if isinstance(layer_cache, mlx_cache.KVCache):
        keys, values = layer_cache.keys, layer_cache.values
        if keys is not None and values is not None:
            # Keep capacity to the next step boundary: cut at an unaligned length, mlx-lm would
            # grow the copy by a whole step from there and outgrow its KV reservation.
            end = layer_cache.offset - drop
            step = mlx_cache.KVCache.step
            capacity = min(keys.shape[2], -(-end // step) * step)
            clone.keys, clone.values = keys[..., :capacity, :], values[..., :capacity, :]
        clone.offset = layer_cache.offset - drop
        return clone
    if isinstance(layer_cache, mlx_cache.QuantizedKVCache):
        qkeys, qvalues = layer_cache.keys, layer_cache.values
        if qkeys is not None and qvalues is not None:
            end = layer_cache.offset - drop
            clone.keys = tuple(a[..., :end, :] for a in qkeys)
            clone.values = tuple(a[..., :end, :] for a in qvalues)
        clone.offset = layer_cache.offset - drop
        return clone
    if isinstance(layer_cache, mlx_cache.ArraysCache):
        clone.cache = [None if a is None else mx.array(a) for a in layer_cache.cache]
        return clone
    raise CannotTrim(f"no copy rule for cache type {type(layer_cache).__name__}")


def _snapshot_layer(layer_cache: Any) -> Any:
    """An independent copy of an untrimmable layer, holding no more than later updates read.

    After a multi-token update a sliding-window ring holds window - 1 + chunk tokens in temporal
    order, but every later update reads only the last window - 1 of them (mlx-lm's
    ``RotatingKVCache``), so the snapshot keeps the last ``max_size`` tokens: a window, not a
    window plus a prefill chunk.
    """
    keys, values = getattr(layer_cache, "keys", None), getattr(layer_cache, "values", None)
    if (
        isinstance(layer_cache, mlx_cache.RotatingKVCache)
        and keys is not None
        and values is not None
    ):
        size, window = int(keys.shape[2]), layer_cache.max_size
        if layer_cache.keep == 0 and size > window and layer_cache._idx == size:
            clone = copy.copy(layer_cache)
            # mx.array(...) copies: a slice alone would keep the whole ring's buffer alive.
            clone.keys = mx.array(keys[..., size - window :, :])
            clone.values = mx.array(values[..., size - window :, :])
            clone._idx = window
            return clone
    return _copy_layer(layer_cache, 0)


def _own(state: SequenceState) -> MlxState:
    if not isinstance(state, MlxState):
        raise TypeError(f"not an MLX state: {type(state).__name__}")
    return state
