"""Bidirectional attention inside image spans, for the families whose reference declares it.

Hugging Face's Gemma 3 lets the soft tokens of one image attend to each other both ways during
prefill (full attention: ``causal OR same block``; sliding: ``window AND (causal OR same block)``);
mlx-vlm 0.7's Gemma 3 runs the causal mask only. So this runs mlx-vlm's own layers one by one with
that overlay added to each layer's cache mask, on the columns of the pass's own tokens. It is exact
because the engine never ends a pass inside a run of soft tokens (``media.inside_span``), and the
backend refuses one that would. Why, and why a restore inside a run would still be exact:
docs/models.md, "Bidirectional inside an image, where the model declares it".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import mlx.core as mx
import numpy as np

from runtime.backends.vision.media import MEDIA_BASE, inside_span

# The mlx-vlm model types whose reference implementation attends bidirectionally inside image
# spans; every other family served (Idefics3 / SmolVLM) is causal there, as its reference is.
DECLARED: Final = frozenset(("gemma3",))


def block_ids(rows: list[list[int]]) -> mx.array:
    """``(B, N)``: for each token of the pass, the number of its run of media tokens in its row,
    -1 for a text token (Hugging Face's block sequence ids)."""
    media = np.asarray(rows, dtype=np.uint64) >= np.uint64(MEDIA_BASE)
    before = np.pad(media[:, :-1], ((0, 0), (1, 0)))
    groups = np.cumsum(media & ~before, axis=1) - 1
    return mx.array(np.where(media, groups, -1).astype(np.int32))


def overlay(base: mx.array, blocks: mx.array, window: int | None) -> mx.array:
    """``base`` (a cache's boolean causal mask for the pass: ``(N, K)`` or ``(B, 1, N, K)``, the
    pass's own keys last) with each block's tokens attending to each other, within ``window``
    positions back where the layer slides."""
    batch, n = blocks.shape
    same = (blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0)
    if window is not None:
        query = mx.arange(n)[:, None]
        key = mx.arange(n)[None]
        same = same & (key > query - window)
    keys = base.shape[-1]
    earlier = mx.zeros((batch, n, keys - n), dtype=mx.bool_)
    extra = mx.concatenate([earlier, same], axis=-1)[:, None]
    return base | extra


def check_language_model(language: Any) -> None:
    """Raises ``TypeError`` unless ``language`` has the shape ``forward`` runs (mlx-vlm's
    Gemma 3 ``LanguageModel``): a load-time check, so a new mlx-vlm fails at once."""
    model = getattr(language, "model", None)
    needed = ("layers", "norm", "sliding_window_pattern", "window_size", "scale_inputs_embeds")
    missing = [n for n in needed if not hasattr(model, n)] + (
        [] if hasattr(language, "lm_head") else ["lm_head"]
    )
    if missing:
        raise TypeError(f"mlx-vlm's language model lacks {', '.join(missing)}")


def forward(language: Any, embeds: mx.array, cache: list[Any], blocks: mx.array) -> mx.array:
    """The logits of mlx-vlm's Gemma 3 ``language`` over ``embeds`` (unscaled input embeddings,
    as it takes them) with ``cache``, image blocks ``blocks`` bidirectional: its own
    ``Gemma3Model.__call__`` with the overlay on each layer's mask."""
    from mlx_vlm.models.base import create_attention_mask

    model = language.model
    h = embeds
    if model.scale_inputs_embeds:  # as Gemma3Model scales them (a bfloat16 constant)
        h = h * mx.array(model.config.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    pattern = model.sliding_window_pattern
    full = overlay(create_attention_mask(h, cache[pattern - 1], return_array=True), blocks, None)
    sliding = full
    if pattern > 1:
        ring = create_attention_mask(h, cache[0], window_size=model.window_size, return_array=True)
        sliding = overlay(ring, blocks, model.window_size)
    for i, (layer, layer_cache) in enumerate(zip(model.layers, cache, strict=True)):
        h = layer(h, full if i % pattern == pattern - 1 else sliding, layer_cache)
    logits: mx.array = language.lm_head(model.norm(h))
    return logits


def check_passes(model: Any, ids: Sequence[int], ends: Sequence[int]) -> None:
    """Raises ``ValueError`` when a pass over ``ids`` would end (at each of ``ends``) inside a
    run of soft tokens of a ``model`` attending both ways there: the engine never plans one, so
    this is a bug caught before it computes wrong keys. (Where the call's ids end, the backend
    cannot see what follows: the engine's ``media.past_span`` keeps that end outside a run.)"""
    if not getattr(model, "bidirectional_spans", False):
        return
    for at in ends:
        if inside_span(ids, at):
            raise ValueError(
                f"a prefill pass would end inside an image's soft tokens (at {at} of "
                f"{len(ids)}), which this model attends to both ways: keep the run whole"
            )
