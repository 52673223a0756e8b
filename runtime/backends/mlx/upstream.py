"""Workarounds for mlx-lm's batching defects, where the fix can be ours.

Batching must not change what a row computes, and some mlx-lm models do, in ways we can undo without
forking mlx-lm: recurrent layers that read a cut or padded pass's state wrongly (ssm, nemotron_h,
rwkv7), masks and query rotations that ignore per-row offsets (gemma2, afm7), a KV layer the model
never writes (nemotron-nas, in ``cache_kinds``) and position ids built from one offset
(gpt_bigcode). The load probe (probe.py) checks the result on the loaded model and switches off what
still fails.

Each defect with the mlx-lm file and line: docs/models.md, "Upstream defects and workarounds".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import afm7, gemma2, gpt_bigcode
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention


def recurrent_parts(layer: Any) -> list[Any]:
    """The recurrent (``ArraysCache``) caches of one batched layer, a ``CacheList``'s included
    (falcon_h1 keeps its SSM state beside its attention in one)."""
    if isinstance(layer, mlx_cache.ArraysCache):
        return [layer]
    if isinstance(layer, mlx_cache.CacheList):
        return [part for child in layer.caches for part in recurrent_parts(child)]
    return []


def piece_lengths(recurrent: Sequence[Any], lengths: Sequence[int], done: int, until: int) -> None:
    """Tell each recurrent batch cache the tokens each row has in the piece ``done:until`` of a
    right-padded pass (negative: the row ended earlier; mlx-lm then keeps its state)."""
    in_piece = [min(n, until) - done for n in lengths]
    for layer in recurrent:  # an array each: a layer's ``advance`` subtracts in place
        layer.lengths = mx.array(in_piece)


def hold_rows(
    recurrent: Sequence[Any], lengths: Sequence[int], column: int
) -> dict[int, list[list[Any]]]:
    """The recurrent state of every row that ends at ``column``, by row (evaluated now: the
    batch's arrays are replaced by later pieces)."""
    held = {
        row: [[None if a is None else a[row : row + 1] for a in layer.cache] for layer in recurrent]
        for row, n in enumerate(lengths)
        if n == column
    }
    mx.eval([a for layers in held.values() for arrays in layers for a in arrays if a is not None])
    return held


def put_rows(recurrent: Sequence[Any], held: dict[int, list[list[Any]]]) -> None:
    """Write each held row's state back into the recurrent batch caches."""
    for row, layers in held.items():
        for layer, arrays in zip(recurrent, layers, strict=True):
            for entry, kept in enumerate(arrays):
                now = layer.cache[entry]
                if kept is not None and now is not None:
                    layer.cache[entry] = mx.concatenate([now[:row], kept, now[row + 1 :]])


def patch_model(model: Any) -> tuple[str, ...]:
    """Apply the model-side workarounds ``model`` needs; the names of those applied."""
    applied = []
    swapped = 0
    for module in _modules(model):
        if type(module) is gemma2.Attention:
            module.__class__ = _Gemma2Attention
            swapped += 1
        elif type(module) is afm7.AFMModel:
            module.__class__ = _AFMModel
            applied.append("afm7 KV-reuse queries rotated at each row's offset")
        elif type(module) is gpt_bigcode.GPTBigCodeModel:
            module.__class__ = _GPTBigCodeModel
            applied.append("gpt_bigcode position ids per row")
    if swapped:
        applied.append("gemma2 attention takes a per-row mask")
    return tuple(applied)


def _modules(model: Any) -> list[Any]:
    modules = getattr(model, "modules", None)
    return list(modules()) if callable(modules) else []


class _Gemma2Attention(gemma2.Attention):
    """gemma2's attention with a per-row mask widened to its grouped 5-axis scores (mlx-lm:
    models/gemma2.py, the ``queries.reshape`` for ``repeats > 1``)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mx.expand_dims(mask, 2)
        return super().__call__(x, mask, cache)


class _GPTBigCodeModel(gpt_bigcode.GPTBigCodeModel):
    """gpt_bigcode with position ids per row when its cache is a batch's (mlx-lm:
    models/gpt_bigcode.py, ``np.arange(cache[0].offset, ...)`` needs one offset)."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        offset = getattr(cache[0], "offset", None) if cache is not None else None
        if not isinstance(offset, mx.array) or offset.ndim != 1:
            alone: mx.array = super().__call__(inputs, cache)
            return alone
        # A row's offset is its own next position (negative while its left padding is fed: those
        # columns are masked out, so any valid id will do there).
        positions = mx.maximum(offset[:, None] + mx.arange(inputs.shape[1])[None], 0)
        hidden = self.wte(inputs) + self.wpe(positions)
        mask = create_attention_mask(hidden, cache[0])
        for layer, layer_cache in zip(self.h, cache, strict=True):
            hidden = layer(hidden, mask, cache=layer_cache)
        out: mx.array = self.ln_f(hidden)
        return out


class _AFMModel(afm7.AFMModel):
    """afm7 whose KV-reuse layers rotate each batch row's queries at that row's own position
    (mlx-lm: models/afm7.py, ``KVReuseAttention`` takes ``offset=S - L``, one for every row)."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        offset = getattr(cache[-1], "offset", None) if cache is not None else None
        if not isinstance(offset, mx.array) or offset.ndim != 1:
            alone: mx.array = super().__call__(inputs, cache)
            return alone
        h = self.embedding(inputs)
        mask = create_attention_mask(h, cache[0])
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            h = layer(h, mask, cache=layer_cache)
        keys, values = cache[-1].keys_and_values()
        starts = cache[-1].offset - inputs.shape[1]  # each row's first position in this pass
        for block in self.kv_reuse_layers:
            normed = block.input_layernorm(h)
            h = h + _reuse_attention(block.self_attn, normed, keys, values, mask, starts)
            h = h + block.mlp(block.post_attention_layernorm(h))
        out: mx.array = self.output_norm(h)
        return out


def _reuse_attention(
    attn: Any, x: mx.array, keys: mx.array, values: mx.array, mask: Any, starts: mx.array
) -> mx.array:
    """``afm7.KVReuseAttention`` with the queries rotated from ``starts`` (one per row)."""
    batch, length, _ = x.shape
    queries = attn.q_proj(x).reshape(batch, length, attn.n_heads, -1).transpose(0, 2, 1, 3)
    queries = attn.q_norm(attn.rope(queries, offset=starts))
    output = scaled_dot_product_attention(
        queries, keys, values, cache=None, scale=attn.scale, mask=mask
    )
    out: mx.array = attn.out_proj(output.transpose(0, 2, 1, 3).reshape(batch, length, -1))
    return out
