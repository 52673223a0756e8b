"""mlx-lm's ``CacheList``: one layer's several caches (falcon_h1 and baichuan_m1: a convolution
state beside an attention cache; deepseek_v32: two KV caches). Each child follows its own kind;
a checkpoint keeps what the untrimmable children need and cuts the others back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_lm.models import cache as mlx_cache

from runtime.backends.mlx.cache_kinds.base import CacheKind, Price

_CacheList: Callable[..., Any] = mlx_cache.CacheList  # untyped in mlx-lm


class CacheListKind(CacheKind):
    """A ``CacheList`` over its children's kinds (found by ``kind_of``)."""

    name = "CacheList"
    batched_form = "CacheList of its children's batched forms"

    def __init__(self, kind_of: Callable[[Any], CacheKind]) -> None:
        self._kind_of = kind_of

    def _each(self, layer: Any) -> list[tuple[CacheKind, Any]]:
        return [(self._kind_of(c), c) for c in layer.caches]

    def describe(self, layer: Any) -> str:
        return f"CacheList({', '.join(k.describe(c) for k, c in self._each(layer))})"

    def cut_back(self, layer: Any) -> bool:
        return all(k.cut_back(c) for k, c in self._each(layer))

    def trimmable(self, layer: Any) -> bool:
        return all(k.trimmable(c) for k, c in self._each(layer))

    def copy(self, layer: Any, drop: int) -> Any:
        return _CacheList(*(k.copy(c, drop) for k, c in self._each(layer)))

    def snapshot(self, layer: Any, back: int) -> Any | None:
        kept = [k.snapshot(c, back) for k, c in self._each(layer)]
        # A CacheList whose cut-back children are None: restore fills them from the source.
        return None if all(c is None for c in kept) else _CacheList(*kept)

    def restore(self, layer: Any, kept: Any | None, drop: int) -> Any:
        if kept is None:
            return self.copy(layer, drop)
        return _CacheList(
            *(
                k.restore(c, s, drop)
                for (k, c), s in zip(self._each(layer), kept.caches, strict=True)
            )
        )

    def rewind(self, layer: Any, drop: int) -> Any | None:
        children = [k.rewind(c, drop) for k, c in self._each(layer)]
        return None if any(c is None for c in children) else _CacheList(*children)

    def reaches_back(self, layer: Any) -> bool:
        return all(k.reaches_back(c) for k, c in self._each(layer))

    def ring(self, layer: Any) -> bool:
        return any(k.ring(c) for k, c in self._each(layer))

    def price(self, layer: Any) -> Price:
        total = Price()
        for kind, child in self._each(layer):
            total = total + kind.price(child)
        return total

    def nbytes(self, layer: Any) -> int:
        return sum(self._kind_of(c).nbytes(c) for c in layer.caches if c is not None)

    def arrays(self, layer: Any) -> list[Any]:
        return [a for c in layer.caches if c is not None for a in self._kind_of(c).arrays(c)]

    def interruptible(self, layer: Any) -> bool:
        return all(k.interruptible(c) for k, c in self._each(layer))

    def undo_copy(self, layer: Any) -> Any:
        return _CacheList(*(k.undo_copy(c) for k, c in self._each(layer)))

    def updaters(self, layer: Any) -> list[Any]:
        return [u for k, c in self._each(layer) for u in k.updaters(c)]

    def batch_refusal(self, layer: Any) -> str | None:
        for kind, child in self._each(layer):
            reason = kind.batch_refusal(child)
            if reason is not None:
                return reason
        return None

    def children(self, layer: Any) -> list[Any]:
        return list(layer.caches)

    def extracted(self, layer: Any) -> Any:
        return _CacheList(*(k.extracted(c) for k, c in self._each(layer)))
