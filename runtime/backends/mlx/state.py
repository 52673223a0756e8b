"""MLX sequence states and snapshots, and how one layer's cache is copied or cut back.

Shared by the backend (one sequence at a time) and the decode batch (many), so neither imports the
other.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from runtime.backends.contract import CannotTrim, SequenceState


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


# Layers that can always be cut back to a shorter prefix (a rotating cache only until it wraps).
TRIMMABLE_LAYERS = (mlx_cache.KVCache, mlx_cache.QuantizedKVCache)


def clone_layer(layer_cache: Any) -> Any:
    """A shallow copy of one layer's cache object, without the per-call hook a pass may have put
    on the original (``interrupt.py``): a snapshot taken mid-call must not update the original."""
    clone = copy.copy(layer_cache)
    vars(clone).pop("update_and_fetch", None)
    return clone


def copy_layer(layer_cache: Any, drop: int) -> Any:
    """An independent copy of one layer's cache minus its last ``drop`` tokens.

    New array objects are made by slicing, so in-place cache updates of the copy never reach the
    original (prefix entries are shared and must not change).
    """
    clone = clone_layer(layer_cache)
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


def snapshot_layer(layer_cache: Any, back: int = 0) -> Any:
    """An independent copy of an untrimmable layer as it was ``back`` tokens ago, holding no more
    than later updates read; raises ``CannotTrim`` if the layer no longer holds that point.

    After a multi-token update a sliding-window ring holds, in temporal order, up to window - 1
    tokens before the update plus the update's own, but every later update reads only the last
    window - 1 of them and a one-token update rotates over a full window (mlx-lm's
    ``RotatingKVCache``). So the snapshot keeps the last ``max_size`` tokens up to its point: a
    window, not a window plus a prefill chunk. Such a ring still holds every point of the update
    that made it, which is what lets a snapshot reach back inside a chunk.
    """
    keys, values = getattr(layer_cache, "keys", None), getattr(layer_cache, "values", None)
    if (
        isinstance(layer_cache, mlx_cache.RotatingKVCache)
        and keys is not None
        and values is not None
        and layer_cache.keep == 0
        and layer_cache._idx == int(keys.shape[2])  # in temporal order (a multi-token update)
    ):
        window, end = layer_cache.max_size, int(keys.shape[2]) - back
        point = layer_cache.offset - back
        if back > 0 and end < min(point, window):
            raise CannotTrim(f"the ring no longer holds a window before token {point}")
        if back > 0 or end > window:
            clone = clone_layer(layer_cache)
            # mx.array(...) copies: a slice alone would keep the whole ring's buffer alive.
            clone.keys = mx.array(keys[..., max(0, end - window) : end, :])
            clone.values = mx.array(values[..., max(0, end - window) : end, :])
            clone.offset = point
            clone._idx = min(end, window)
            return clone
    if back > 0:
        raise CannotTrim(f"a {type(layer_cache).__name__} holds only its latest state")
    return copy_layer(layer_cache, 0)


def reaches_back(layer_cache: Any) -> bool:
    """Whether ``snapshot_layer`` can reach back inside this layer's last multi-token update."""
    if isinstance(layer_cache, TRIMMABLE_LAYERS):
        return True
    return isinstance(layer_cache, mlx_cache.RotatingKVCache) and layer_cache.keep == 0


def own_state(state: SequenceState) -> MlxState:
    if not isinstance(state, MlxState):
        raise TypeError(f"not an MLX state: {type(state).__name__}")
    return state
