"""Several prompts prefilled in one batched pass, each into its own sequence state.

A pass over B rows reads every weight once, so on a CPU (and on a GPU with a small model) a padded
batch of prompts costs each one less than its own pass: ~0.8x per 64-token prompt in a batch of 8 on
SmolLM2-135M and Gemma 3 270M (scripts/batched_prefill_gain.py). This is mlx-lm's own batch prompt
processing (``PromptProcessingBatch``): per-sequence caches merged, the prompts padded, the last
tokens run as one more pass, each row extracted again. Every cache kind mlx-lm batches works.

Where snapshots are taken, and the recurrent-layer workarounds: docs/design.md, "Prompts prefilled
together".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from runtime.backends.mlx.cache_kinds import (
    extract_row,
    finalize_layer,
    kind_of,
    snapshot_layers,
)
from runtime.backends.mlx.state import MlxSnapshot, MlxState
from runtime.backends.mlx.upstream import hold_rows, piece_lengths, put_rows, recurrent_parts


def prefill_together(
    model: Any,
    states: Sequence[MlxState],
    token_ids: Sequence[Sequence[int]],
    snapshot_at: Sequence[Sequence[int]] = (),
    reach_back: bool = False,
    whole: bool = False,
) -> list[list[MlxSnapshot]]:
    """Extend each state in ``states`` with its ``token_ids`` (at least 2), keeping the logits
    after its last token, and snapshot each at its ``snapshot_at`` lengths (sorted, each within
    what its ids add). A state may hold a cached prefix already (of any length: ``merge`` pads the
    shorter ones on the left, as mlx-lm's ``BatchGenerator`` does with cached prompts).
    ``reach_back``: every layer still holds every point of a pass after it (no recurrent one).
    ``whole``: snapshots copy every layer (the backend's fallback where trimming proved wrong)."""
    if len(states) != len(token_ids):
        raise ValueError("one list of token ids per state")
    if any(len(ids) < 2 for ids in token_ids):
        raise ValueError("prefill_together takes 2 tokens or more per state")
    points = list(snapshot_at) or [[] for _ in token_ids]
    starts = [s.n_tokens for s in states]
    ends = [start + len(ids) for start, ids in zip(starts, token_ids, strict=True)]
    untrimmable = [i for i, c in enumerate(states[0].caches) if whole or not kind_of(c).cut_back(c)]
    taken: list[dict[int, MlxSnapshot]] = [{} for _ in states]
    cuts: dict[int, list[int]] = {}  # column of the padded pass -> rows snapshotted there
    if not reach_back:
        for row, (at, start, end) in enumerate(zip(points, starts, ends, strict=True)):
            for point in at:
                if point < end - 1:
                    cuts.setdefault(point - start, []).append(row)
    rotating = any(kind_of(c).ring(c) for c in states[0].caches)
    if cuts and rotating:
        raise ValueError("a pass with sliding-window layers cannot be cut for a snapshot")

    layers = len(states[0].caches)
    batch = [states[0].caches[i].merge([s.caches[i] for s in states]) for i in range(layers)]
    heads = [list(ids[:-1]) for ids in token_ids]
    lengths = [len(h) for h in heads]
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    inputs = mx.array([h + [0] * (longest - len(h)) for h in heads])
    if any(padding):
        for layer in batch:
            layer.prepare(lengths=lengths, right_padding=padding)
    # Recurrent layers of a padded pass are cut at each row's end and keep the state they had
    # there (upstream.py: mlx-lm reads them wrong past a row's end, or runs padding through them).
    # Not beside sliding-window layers: mlx-lm's BatchRotatingKVCache refuses a one-token piece
    # of a right-padded pass; there the load probe judges mlx-lm's own padded pass instead.
    recurrent = [part for layer in batch for part in recurrent_parts(layer)]
    ended = set(lengths) if recurrent and any(padding) and not rotating else set()
    kept_rows: dict[int, list[list[Any]]] = {}
    done = 0
    for column in sorted({*cuts, *ended, longest}):
        if column > done:
            if ended:
                piece_lengths(recurrent, lengths, done, column)
            model(inputs[:, done:column], cache=batch)
            done = column
        if column in ended:
            kept_rows.update(hold_rows(recurrent, lengths, column))
        for row in cuts.get(column, ()):
            point = starts[row] + column
            taken[row].update(_copy_row(batch, row, untrimmable, point, [point], whole))
    put_rows(recurrent, kept_rows)
    if any(padding):
        for layer in batch:
            finalize_layer(layer)
    # Every row now stands one token before its end, each sliding ring holding the pass's tokens
    # and a window before them: the points before the end are reached from here.
    for row, (at, end) in enumerate(zip(points, ends, strict=True)):
        before_end = [p for p in at if p < end and p not in taken[row]]
        if before_end:
            taken[row].update(_copy_row(batch, row, untrimmable, end - 1, before_end, whole))
    last = mx.array([[ids[-1]] for ids in token_ids])
    logits = model(last, cache=batch)[:, -1].astype(mx.float32)
    for row, (state, ids) in enumerate(zip(states, token_ids, strict=True)):
        state.caches = [extract_row(layer, row) for layer in batch]
        state.n_tokens += len(ids)
        state.logits = logits[row]
        if state.n_tokens in points[row]:  # the end: the row's own state, as it is
            taken[row][state.n_tokens] = MlxSnapshot(
                snapshot_layers(dict(enumerate(state.caches)), 0, whole), state.n_tokens
            )
    snapshots = [[taken[row][p] for p in at] for row, at in enumerate(points)]
    kept = [s.arrays() for row in snapshots for s in row]
    mx.eval([c.state for s in states for c in s.caches], [s.logits for s in states], kept)
    return snapshots


def together_snapshot_tokens(caches: Sequence[Any], context: int, reach_back: bool) -> int:
    """The longest prompt whose every snapshot ``prefill_together`` takes (``ModelInfo``'s
    ``together_snapshot_tokens``): any, unless sliding-window layers (whose pass cannot be cut)
    sit beside layers a pass cannot reach back into (``reach_back`` False): then none."""
    rotating = any(kind_of(c).ring(c) for c in caches)
    return 0 if rotating and not reach_back else context


def _copy_row(
    batch: list[Any],
    row: int,
    untrimmable: list[int],
    length: int,
    points: Sequence[int],
    whole: bool,
) -> dict[int, MlxSnapshot]:
    """``row``'s untrimmable layers at each of ``points``, from the batch caches as they hold it
    now (``length`` tokens in; an earlier point reached back inside the ring)."""
    held = {i: extract_row(batch[i], row) for i in untrimmable}
    taken = {
        point: MlxSnapshot(snapshot_layers(held, length - point, whole), point) for point in points
    }
    # Evaluated now: the batch caches' arrays go on changing under later passes.
    mx.eval([s.arrays() for s in taken.values()])
    return taken
