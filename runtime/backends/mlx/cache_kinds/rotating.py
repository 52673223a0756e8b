"""Sliding-window attention: mlx-lm's ``RotatingKVCache``, a ring of the last ``max_size`` tokens
(plus ``keep`` leading ones it never drops). It can be cut back only until it wraps, so a
checkpoint copies it; a copy taken after a multi-token update can reach back inside it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from runtime.backends.contract import CannotTrim
from runtime.backends.mlx.cache_kinds.base import (
    CacheKind,
    Price,
    clone_layer,
    kv_bytes_per_token,
    padded_to,
    whole_steps,
)


class RotatingKind(CacheKind):
    name = "RotatingKVCache"
    batched_form = "BatchRotatingKVCache (rows left-padded, the padding masked; keep = 0 only)"

    def describe(self, layer: Any) -> str:
        return f"RotatingKVCache (window {layer.max_size})"

    def copy(self, layer: Any, drop: int) -> Any:
        if drop and not layer.is_trimmable():
            raise CannotTrim(f"a wrapped sliding window of {layer.max_size} cannot be cut back")
        clone = clone_layer(layer)
        keys, values = layer.keys, layer.values
        if keys is not None and values is not None:
            if drop == 0:  # possibly wrapped around: copy the whole ring
                clone.keys, clone.values = mx.array(keys), mx.array(values)
            else:  # trimmable means not wrapped: tokens sit in order before _idx
                # Capacity to the next step boundary (whole_steps), as KVKind.copy keeps.
                end = layer._idx - drop
                capacity = min(keys.shape[2], whole_steps(end, layer.step))
                clone.keys, clone.values = keys[..., :capacity, :], values[..., :capacity, :]
        clone.offset = layer.offset - drop
        clone._idx = layer._idx - drop
        return clone

    def snapshot(self, layer: Any, back: int) -> Any | None:
        """After a multi-token update the ring holds, in temporal order, up to window - 1 tokens
        before the update plus the update's own, but every later update reads only the last
        window - 1 of them and a one-token update rotates over a full window (mlx-lm's
        ``RotatingKVCache``). So the snapshot keeps the last ``max_size`` tokens up to its point:
        a window, not a window plus a prefill chunk. Such a ring still holds every point of the
        update that made it, which is what lets a snapshot reach back inside a chunk.
        """
        keys, values = layer.keys, layer.values
        if (
            keys is not None
            and values is not None
            and layer.keep == 0
            # In temporal order: a multi-token update's ring, or one never wrapped (a row out
            # of a batch or a cut-back copy may hold room past _idx).
            and (layer._idx == int(keys.shape[2]) or layer.offset == layer._idx)
        ):
            window, end = layer.max_size, layer._idx - back
            point = layer.offset - back
            if back > 0 and end < min(point, window):
                raise CannotTrim(f"the ring no longer holds a window before token {point}")
            if back > 0 or end > window:
                clone = clone_layer(layer)
                # mx.array(...) copies: a slice alone would keep the whole ring's buffer alive.
                clone.keys = mx.array(keys[..., max(0, end - window) : end, :])
                clone.values = mx.array(values[..., max(0, end - window) : end, :])
                clone.offset = point
                clone._idx = min(end, window)
                return clone
        if back > 0:
            raise CannotTrim("a RotatingKVCache holds only its latest state here")
        return self.copy(layer, 0)

    def rewind(self, layer: Any, drop: int) -> Any | None:
        """A multi-token update leaves the ring in temporal order, ending with the update's own
        tokens (``_update_concat``), so the update minus its last ``drop`` tokens is the same ring
        cut short: exactly what feeding only the kept tokens would have left."""
        keys, values = layer.keys, layer.values
        if keys is None or values is None or layer._idx != int(keys.shape[2]):
            return None
        end = int(keys.shape[2]) - drop
        clone = clone_layer(layer)
        clone.keys, clone.values = keys[..., :end, :], values[..., :end, :]
        clone.offset = layer.offset - drop
        clone._idx = end
        return clone

    def reaches_back(self, layer: Any) -> bool:
        return int(layer.keep) == 0

    def ring(self, layer: Any) -> bool:
        return True

    def price(self, layer: Any) -> Price:
        return Price(window=int(layer.max_size), window_per_token=kv_bytes_per_token(layer))

    def batch_refusal(self, layer: Any) -> str | None:
        if layer.keep:
            return "a RotatingKVCache with keep > 0 (BatchRotatingKVCache drops kept tokens)"
        return None

    def extracted(self, layer: Any) -> Any:
        if layer.keys is None:
            return layer
        # A ring never grows past its window (snapshot reads a never-wrapped ring with room
        # past _idx as in temporal order).
        cells = min(whole_steps(int(layer.keys.shape[2]), layer.step), layer.max_size)
        return padded_to(layer, cells)
