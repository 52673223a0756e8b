"""Attention caches that hold every token they attend to: full attention (``KVCache``, its
quantized and concatenating forms), cut back to any prefix, and llama4's chunked attention
(``ChunkedKVCache``), which holds only the chunk each new token attends to and is snapshotted.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from runtime.backends.contract import CannotTrim
from runtime.backends.mlx.cache_kinds.base import (
    CacheKind,
    Price,
    clone_layer,
    kv_bytes_per_token,
    padded_to,
    whole_steps,
)


class _FullAttention(CacheKind):
    """A cache of every token so far: a checkpoint cuts it back from the state it came from."""

    def cut_back(self, layer: Any) -> bool:
        return True

    def snapshot(self, layer: Any, back: int) -> Any | None:
        return None

    def reaches_back(self, layer: Any) -> bool:
        return True

    def price(self, layer: Any) -> Price:
        return Price(per_token=kv_bytes_per_token(layer))

    def rewind(self, layer: Any, drop: int) -> Any | None:
        if type(layer) is mlx_cache.ConcatenateKVCache:
            return self.copy(layer, drop)  # its arrays are exactly as long as its tokens
        # mlx-lm's own trim: the buffer stays, the next update writes over the dropped tokens.
        clone = clone_layer(layer)
        clone.offset = _cut_offset(layer, drop)
        return clone


def _cut_offset(layer: Any, drop: int) -> int:
    """A copy's offset, ``drop`` tokens back. A layer the model never writes to (nemotron-nas's
    linear-replaced attention keeps an empty KVCache) stays at 0: a negative offset would make
    mlx-lm's ``BatchKVCache.merge`` read the shape of keys that are not there."""
    return 0 if layer.keys is None else int(layer.offset) - drop


class KVKind(_FullAttention):
    name = "KVCache"
    batched_form = "BatchKVCache (rows left-padded, the padding masked)"

    def copy(self, layer: Any, drop: int) -> Any:
        """Prefix entries are shared and must not change: new array objects are made by slicing,
        so in-place updates of the copy never reach the original."""
        clone = clone_layer(layer)
        keys, values = layer.keys, layer.values
        if keys is not None and values is not None:
            # Capacity to the next step boundary (whole_steps), no more than the buffer holds.
            capacity = min(keys.shape[2], whole_steps(layer.offset - drop, layer.step))
            clone.keys, clone.values = keys[..., :capacity, :], values[..., :capacity, :]
        clone.offset = _cut_offset(layer, drop)
        return clone

    def batch_refusal(self, layer: Any) -> str | None:
        return None

    def extracted(self, layer: Any) -> Any:
        if layer.keys is None:  # a layer the model never writes to: nothing to grow
            return layer
        return padded_to(layer, whole_steps(int(layer.keys.shape[2]), layer.step))


class QuantizedKind(_FullAttention):
    name = "QuantizedKVCache"

    def copy(self, layer: Any, drop: int) -> Any:
        clone = clone_layer(layer)
        qkeys, qvalues = layer.keys, layer.values
        if qkeys is not None and qvalues is not None:
            end = layer.offset - drop
            clone.keys = tuple(a[..., :end, :] for a in qkeys)
            clone.values = tuple(a[..., :end, :] for a in qvalues)
        clone.offset = _cut_offset(layer, drop)
        return clone


class ConcatenateKind(_FullAttention):
    """Keys and values exactly as long as the tokens: each update concatenates new arrays."""

    name = "ConcatenateKVCache"

    def copy(self, layer: Any, drop: int) -> Any:
        # mlx-lm's own trim only lowers the offset and the next update appends after the
        # dropped tokens; cutting the arrays keeps the copy right.
        clone = clone_layer(layer)
        if layer.keys is not None and layer.values is not None:
            end = layer.offset - drop
            clone.keys, clone.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        clone.offset = _cut_offset(layer, drop)
        return clone


class ChunkedKind(CacheKind):
    """llama4's chunked attention: a token attends only to the earlier tokens of its chunk of
    ``chunk_size``, and before each pass the cache drops all but the last ``chunk_size`` tokens
    (``start_position`` is the first one held). Every chunked layer of a model shares the mask
    built from the first one's ``start_position``, so each copy moves all of them alike.

    A point ``p`` is restorable while the cache still holds its chunk's start (``p // chunk *
    chunk``): always inside the last multi-token update, since a pass drops only tokens from
    ``chunk_size`` before its start. A snapshot keeps just that chunk's tokens before ``p``.
    """

    name = "ChunkedKVCache"

    def describe(self, layer: Any) -> str:
        return f"ChunkedKVCache (chunk {layer.chunk_size})"

    def trimmable(self, layer: Any) -> bool:
        # mlx-lm says always; once the front was dropped an earlier chunk's start may be gone.
        return int(layer.start_position) == 0

    def copy(self, layer: Any, drop: int) -> Any:
        point = layer.offset - drop
        self._check_holds(layer, point)
        clone = clone_layer(layer)
        if layer.keys is not None and layer.values is not None:
            end = point - layer.start_position
            clone.keys, clone.values = layer.keys[..., :end, :], layer.values[..., :end, :]
        clone.offset = point
        return clone

    def snapshot(self, layer: Any, back: int) -> Any | None:
        point = layer.offset - back
        self._check_holds(layer, point)
        clone = clone_layer(layer)
        if layer.keys is not None and layer.values is not None:
            first = point // layer.chunk_size * layer.chunk_size
            lo, hi = first - layer.start_position, point - layer.start_position
            # mx.array(...) copies: a slice alone would keep the whole buffer alive.
            clone.keys = mx.array(layer.keys[..., lo:hi, :])
            clone.values = mx.array(layer.values[..., lo:hi, :])
            clone.start_position = first
        clone.offset = point
        return clone

    def reaches_back(self, layer: Any) -> bool:
        return True

    def price(self, layer: Any) -> Price:
        # Its buffer grows in whole steps past the chunk it keeps before a pass: a chunk and a
        # step cover passes of up to a step (the engine's default chunk); a longer one, more.
        window = int(layer.chunk_size) + mlx_cache.ChunkedKVCache.step
        return Price(window=window, window_per_token=kv_bytes_per_token(layer))

    def arrays(self, layer: Any) -> list[Any]:
        return [] if layer.empty() else [layer.keys, layer.values]

    @staticmethod
    def _check_holds(layer: Any, point: int) -> None:
        first = point // layer.chunk_size * layer.chunk_size
        if not layer.start_position <= point <= layer.offset or (layer.start_position > first):
            raise CannotTrim(
                f"the chunked cache (tokens {layer.start_position}-{layer.offset}) no longer "
                f"holds the chunk of token {point}"
            )
