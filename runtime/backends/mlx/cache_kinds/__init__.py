"""One adapter per mlx-lm cache class: everything the MLX backend does with a layer's cache.

mlx-lm models keep each layer's cache in one of the classes of ``mlx_lm/models/cache.py``; how a
layer is copied, snapshotted, restored, cut back, priced, undone after an interrupted pass and
batched depends only on that class. Each class has one ``CacheKind`` here (``KINDS``, keyed by
the exact class), and the backend's modules (``state``, ``backend``, ``batch``, ``together``,
``interrupt``, ``facts``) ask it instead of testing classes themselves. A model whose cache holds
a class without an adapter is refused when it loads (``check_supported``), never at a request.
To support a new class, add its ``CacheKind`` and register it in ``KINDS``. See docs/design.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mlx_lm.models import cache as mlx_cache

from runtime.backends.mlx.cache_kinds.attention import (
    ChunkedKind,
    ConcatenateKind,
    KVKind,
    QuantizedKind,
)
from runtime.backends.mlx.cache_kinds.base import CacheKind, Price, clone_layer
from runtime.backends.mlx.cache_kinds.composite import CacheListKind
from runtime.backends.mlx.cache_kinds.recurrent import ArraysKind
from runtime.backends.mlx.cache_kinds.rotating import RotatingKind
from runtime.errors import UnsupportedCache

__all__ = [
    "KINDS",
    "CacheKind",
    "Price",
    "check_supported",
    "clone_layer",
    "extract_row",
    "finalize_layer",
    "kind_of",
    "price_of",
    "snapshot_layers",
]


def kind_of(layer: Any) -> CacheKind:
    """The adapter of ``layer``'s exact class; raises ``UnsupportedCache`` if it has none."""
    kind = KINDS.get(type(layer))
    if kind is None:
        raise UnsupportedCache(_refusal(type(layer), None))
    return kind


KINDS: dict[type, CacheKind] = {
    mlx_cache.KVCache: KVKind(),
    mlx_cache.QuantizedKVCache: QuantizedKind(),
    mlx_cache.ConcatenateKVCache: ConcatenateKind(),
    mlx_cache.ChunkedKVCache: ChunkedKind(),
    mlx_cache.RotatingKVCache: RotatingKind(),
    mlx_cache.ArraysCache: ArraysKind(),
    mlx_cache.CacheList: CacheListKind(kind_of),
}
# Older mlx-lm releases keep Mamba's state in an ArraysCache subclass of its own.
if (_mamba := getattr(mlx_cache, "MambaCache", None)) is not None:
    KINDS[_mamba] = KINDS[mlx_cache.ArraysCache]


def check_supported(caches: Iterable[Any], architecture: str | None) -> None:
    """Raise ``UnsupportedCache`` naming the first cache class (a ``CacheList``'s children
    included) that has no adapter, and ``architecture`` (the config's ``model_type``)."""
    for layer in caches:
        kind = KINDS.get(type(layer))
        if kind is None:
            raise UnsupportedCache(_refusal(type(layer), architecture))
        check_supported(kind.children(layer), architecture)


def snapshot_layers(layers: Mapping[int, Any], back: int, whole: bool = False) -> dict[int, Any]:
    """What a checkpoint keeps of each of ``layers`` (by layer index) as it was ``back`` tokens
    ago (layers that are cut back instead are left out, unless ``whole``: the backend's fallback
    where the load probe found cutting back wrong, so every layer is copied); raises
    ``CannotTrim``."""
    kept = ((i, _kept(kind_of(c), c, back, whole)) for i, c in layers.items())
    return {i: k for i, k in kept if k is not None}


def _kept(kind: CacheKind, layer: Any, back: int, whole: bool) -> Any | None:
    if whole and kind.cut_back(layer):
        return kind.copy(layer, back)
    return kind.snapshot(layer, back)


def extract_row(batch_layer: Any, row: int) -> Any:
    """Row ``row`` of a batched layer as a per-sequence cache. A batched KV layer the model never
    wrote to (nemotron-nas's no-op attention) gives an empty one: mlx-lm's ``extract`` slices its
    keys, which are None there."""
    if isinstance(batch_layer, mlx_cache.BatchKVCache) and batch_layer.keys is None:
        return mlx_cache.KVCache()  # type: ignore[no-untyped-call]
    extracted = batch_layer.extract(row)
    return kind_of(extracted).extracted(extracted)


def finalize_layer(batch_layer: Any) -> None:
    """End a right-padded batched pass on one layer: mlx-lm rolls each row's padding to its left.
    A KV layer the model never wrote to has no keys to roll (mlx-lm's ``finalize`` would read
    their shape): its rows stay empty, and ``extract_row`` gives them back empty."""
    if isinstance(batch_layer, mlx_cache.BatchKVCache) and batch_layer.keys is None:
        batch_layer._right_padding = None
        return
    batch_layer.finalize()


def price_of(caches: Iterable[Any]) -> Price:
    """What a state's layers cost, read off their arrays after a pass."""
    total = Price()
    for layer in caches:
        total = total + kind_of(layer).price(layer)
    return total


def _refusal(cls: type, architecture: str | None) -> str:
    model = f"the {architecture!r} architecture" if architecture else "this model"
    known = ", ".join(sorted(k.__name__ for k in KINDS))
    return (
        f"{model} keeps its cache in {cls.__module__}.{cls.__qualname__}, which this runtime "
        f"cannot copy, snapshot, price or batch (it knows {known}); serve this model with "
        "mlx-lm directly, or add an adapter for the class in runtime/backends/mlx/cache_kinds"
    )
