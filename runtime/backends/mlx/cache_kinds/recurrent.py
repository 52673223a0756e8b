"""Recurrent state: mlx-lm's ``ArraysCache`` (and ``MambaCache`` where an mlx-lm still has it),
a fixed-size state per layer (SSM state, convolution tail, linear-attention memory). It holds only
its latest step, so it is never cut back and a snapshot cannot reach inside a pass.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from runtime.backends.contract import CannotTrim
from runtime.backends.mlx.cache_kinds.base import CacheKind, Price, clone_layer


class ArraysKind(CacheKind):
    name = "ArraysCache"
    batched_form = "ArraysCache with a batch axis (a state per row, no padding held)"

    def trimmable(self, layer: Any) -> bool:
        return False

    def copy(self, layer: Any, drop: int) -> Any:
        if drop:
            raise CannotTrim(f"a {type(layer).__name__} holds only its latest state")
        clone = clone_layer(layer)
        clone.cache = [None if a is None else mx.array(a) for a in layer.cache]
        return clone

    def snapshot(self, layer: Any, back: int) -> Any | None:
        if back:
            raise CannotTrim(f"a {type(layer).__name__} holds only its latest state")
        return self.copy(layer, 0)

    def price(self, layer: Any) -> Price:
        return Price(fixed=int(layer.nbytes))

    def undo_copy(self, layer: Any) -> Any:
        clone = clone_layer(layer)
        clone.cache = list(layer.cache)  # its layers assign into this list
        return clone

    def batch_refusal(self, layer: Any) -> str | None:
        return None
