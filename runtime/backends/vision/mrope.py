"""M-RoPE positions for Qwen2-VL and Qwen2.5-VL, kept in the cache so every path restores them.

These families give each soft token a 3-D (time, row, column) position from its image's merged
grid, and the text after it the next position past the grid's largest extent, not past its token
count (mlx-vlm's ``get_rope_index``). A token's position thus depends on every token before it,
which a prefix cache keyed on token offsets cannot rebuild alone. So a sequence's cache carries
one more layer, a ``KVCache`` holding per token the next free position and its span's base: the
cache kinds copy, cut back, snapshot, restore, batch and persist it with the other layers, and it
gives each pass its first token's position; within a pass positions follow from the media ids
(their image's grid and offset). docs/models.md, "M-RoPE positions".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

import mlx.core as mx

from runtime.backends.vision.media import MEDIA_BASE, split_media

GRID_FAMILIES: Final = frozenset(("qwen2_vl", "qwen2_5_vl"))
Grid = tuple[int, int, int]  # an image's merged (time, rows, columns)


def start_of(track: Any, batch: int) -> mx.array:
    """``(B, 2)`` int32: each row's next free position and last span base (zeros: empty)."""
    length = getattr(track, "_idx", None)  # a batch cache's columns; a KVCache's offset
    length = track.offset if length is None else length
    if track.keys is None or not length:
        return mx.zeros((batch, 2), dtype=mx.int32)
    start: mx.array = track.keys[:, 0, length - 1, :]
    return start


def text_positions(start: mx.array, batch: int, length: int) -> tuple[mx.array, mx.array]:
    """Positions ``(3, B, L)`` and stored values ``(B, L, 2)`` of a pass of text only: lazy,
    so a pipelined decode step never waits on it."""
    pos = start[:, :1] + mx.arange(length, dtype=mx.int32)[None]
    stored = mx.stack([pos + 1, pos], axis=-1)
    return mx.broadcast_to(pos[None], (3, batch, length)), stored


def media_positions(
    rows: list[list[int]], start: mx.array, grid_of: Callable[[int], Grid]
) -> tuple[mx.array, mx.array]:
    """As ``text_positions`` for a pass holding media ids, row by row as ``get_rope_index``
    numbers them; a pass may start inside a span (its base is the stored one)."""
    starts = cast("list[list[int]]", start.tolist())
    positions: list[list[list[int]]] = [[], [], []]
    stored: list[list[tuple[int, int]]] = []
    for row, (nxt, base) in zip(rows, starts, strict=True):
        axes: list[list[int]] = [[], [], []]
        kept: list[tuple[int, int]] = []
        for token in row:
            if token >= MEDIA_BASE:
                key, offset = split_media(token)
                if offset == 0:
                    base = nxt
                _, rows_n, cols = grid_of(key)
                t, rest = divmod(offset, rows_n * cols)
                here = (base + t, base + rest // cols, base + rest % cols)
                nxt = max(nxt, max(here) + 1)
            else:
                base = nxt
                here = (nxt, nxt, nxt)
                nxt += 1
            for axis, value in zip(axes, here, strict=True):
                axis.append(value)
            kept.append((nxt, base))
        for d in range(3):
            positions[d].append(axes[d])
        stored.append(kept)
    return mx.array(positions, dtype=mx.int32), mx.array(stored, dtype=mx.int32)


def forward(
    language: Any,
    ids: mx.array,
    embeds: mx.array | None,
    cache: list[Any] | None,
    rows: list[list[int]] | None,
    grid_of: Callable[[int], Grid],
) -> mx.array:
    """The logits of mlx-vlm's Qwen2-VL ``language`` over ``ids`` (``embeds`` where media are
    in the pass; ``rows``: its ids as lists then) with ``cache``, its last layer the positions."""
    batch, length = ids.shape
    layers, track = (None, None) if cache is None else (cache[:-1], cache[-1])
    start = mx.zeros((batch, 2), mx.int32) if track is None else start_of(track, batch)
    if rows is None:
        pos, stored = text_positions(start, batch, length)
    else:
        pos, stored = media_positions(rows, start, grid_of)
    if track is not None:
        track.update_and_fetch(stored[:, None], stored[:, None])
    out = language(ids, inputs_embeds=embeds, cache=layers, position_ids=pos)
    logits: mx.array = out.logits
    return logits
