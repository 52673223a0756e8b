"""An mlx-vlm model in the shape of an mlx-lm one, so the MLX backend runs it unchanged.

``model(ids, cache=caches)`` returns logits; ``make_cache`` gives mlx-lm's cache classes. Text runs
through the language model as it would alone, so a text request keeps reuse, batching, samplers and
constraints. A pass whose ids hold media ids (int64, ``media.py``) embeds its text, puts each
image's features (``MediaStore.features``) at its soft tokens as mlx-vlm's ``get_input_embeddings``
lays them out, and runs the language model on those embeddings; Gemma 3 through
``bidirectional.forward``, the others causally, as their references are (docs/models.md).
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from runtime.backends.vision import bidirectional, mrope
from runtime.backends.vision.media import MEDIA_BASE, split_media
from runtime.backends.vision.store import MediaStore
from runtime.errors import UnsupportedCache


class VisionTextModel:
    """The language model of ``vlm`` fed token ids and media ids (see the module docstring);
    ``parameters``, ``update`` and ``modules`` are the whole VLM's, as an mlx-lm model's are."""

    def __init__(
        self, vlm: Any, store: MediaStore, bidirectional_spans: bool = False, grid: bool = False
    ) -> None:
        self.vlm = vlm
        self._store = store
        # M-RoPE grid positions (Qwen2-VL): one more cache layer keeps them (mrope.py).
        self.grid_positions = grid
        # Whether a pass's runs of soft tokens attend to each other both ways (bidirectional.py).
        self.bidirectional_spans = bidirectional_spans
        if bidirectional_spans:
            bidirectional.check_language_model(vlm.language_model)

    def parameters(self) -> Any:
        return self.vlm.parameters()

    def update(self, parameters: Any) -> Any:
        return self.vlm.update(parameters)

    def modules(self) -> list[Any]:
        return list(self.vlm.modules())

    @property
    def layers(self) -> Any:
        return self.vlm.language_model.layers

    def make_cache(self) -> list[Any]:
        """mlx-lm's cache of each layer, like the one mlx-vlm would make."""
        language = self.vlm.language_model
        if not hasattr(language, "make_cache"):
            extra = 1 if self.grid_positions else 0  # the positions layer, last
            return [mlx_cache.KVCache() for _ in range(len(self.layers) + extra)]  # type: ignore[no-untyped-call]
        caches: list[Any] = []
        for made in language.make_cache():
            name = type(made).__name__
            if name == "KVCache":
                caches.append(mlx_cache.KVCache())  # type: ignore[no-untyped-call]
            elif name == "RotatingKVCache":
                ring = mlx_cache.RotatingKVCache(max_size=made.max_size, keep=made.keep)  # type: ignore[no-untyped-call]
                caches.append(ring)
            else:
                raise UnsupportedCache(
                    f"this vision-language model's layers use mlx-vlm's {name}, which the "
                    "runtime has no adapter for; only KVCache and RotatingKVCache layers load"
                )
        return caches

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        language = self.vlm.language_model
        grid = self._store.grid if self.grid_positions else None
        if inputs.dtype != mx.int64:  # no media id fits 32 bits: text only, as it runs alone
            if grid is not None:
                return mrope.forward(language, inputs, None, cache, None, grid)
            logits: mx.array = language(inputs, cache=cache).logits
            return logits
        media = inputs >= MEDIA_BASE
        ids = mx.where(media, 0, inputs).astype(mx.int32)
        embeds = self.vlm.get_input_embeddings(ids, None).inputs_embeds
        listed = cast("list[list[int]]", inputs.tolist())
        positions, rows = self._media_rows(listed)
        if positions:
            batch, length, hidden = embeds.shape
            flat = embeds.reshape(batch * length, hidden)
            flat[mx.array(positions)] = rows.astype(flat.dtype)
            embeds = flat.reshape(batch, length, hidden)
        if grid is not None:
            return mrope.forward(language, ids, embeds, cache, listed, grid)
        if self.bidirectional_spans and positions and inputs.shape[1] > 1:
            blocks = bidirectional.block_ids(listed)
            return bidirectional.forward(language, embeds, cache, blocks)
        out: mx.array = language(ids, inputs_embeds=embeds, cache=cache).logits
        return out

    def _media_rows(self, rows: list[list[int]]) -> tuple[list[int], mx.array]:
        """Flat positions of the media ids in ``rows`` and their features, in that order."""
        positions: list[int] = []
        pieces: list[mx.array] = []
        width = len(rows[0])
        for r, row in enumerate(rows):
            c = 0
            while c < width:
                if row[c] < MEDIA_BASE:
                    c += 1
                    continue
                key, first = split_media(row[c])
                end = c + 1  # a run of one image's consecutive soft tokens
                while (
                    end < width
                    and row[end] >= MEDIA_BASE
                    and split_media(row[end]) == (key, first + end - c)
                ):
                    end += 1
                features = self._store.features(key)
                pieces.append(features[first : first + end - c])
                positions.extend(range(r * width + c, r * width + end))
                c = end
        return positions, mx.concatenate(pieces) if pieces else mx.zeros((0,))
