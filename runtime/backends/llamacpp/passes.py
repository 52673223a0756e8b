"""How the rows of one decode become ``llama_decode`` calls: no token's result depends on the call.

llama.cpp's CPU matrix multiply picks its kernel by the number of columns: a sequence with a
single row in a pass goes through the vector kernels, two or more through llamafile's tiled ones,
and the two sum in another order, so a token decoded alone differs (0.2-0.8 in the logits on
SmolLM2) from the same token inside a prompt, and a reused second turn would differ from a cold
one. With ``exact_reuse`` (where llamafile's kernels are built in), a lone row gets a throwaway row
of its own sequence, and rows are planned into calls where every sequence has the same number of
rows, two or more. The cost: 1.83x a B=1 decode step on SmolLM2, 1.5-1.6x a step of 4 or 8.

Why it makes SmolLM2 exact and not Gemma 3: docs/models.md, the llama.cpp backend's exact reuse.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class Row(NamedTuple):
    """One token of a ``llama_batch``: its sequence, position, and whether to keep its logits."""

    seq: int
    pos: int
    token: int
    logits: bool


class Call(NamedTuple):
    """One ``llama_decode``: its rows; for each row that keeps logits, its index in this call and
    its index in the planned rows; and the (sequence, position) of each throwaway row, whose
    cell is removed after the call."""

    rows: list[Row]
    logits_at: list[tuple[int, int]]
    padded: list[tuple[int, int]]


def plan_calls(rows: Sequence[Row], n_batch: int, *, pad: bool) -> list[Call]:
    """``rows`` (each sequence's in position order, at most ``n_batch`` in all) as calls of at
    most ``n_batch`` rows; with ``pad``, calls in which every sequence has the same number of
    rows, two or more (module docstring)."""
    if not pad:
        wanted = [(i, i) for i, row in enumerate(rows) if row.logits]
        return [Call(list(rows), wanted, [])]
    left: dict[int, list[tuple[int, Row]]] = {}
    for index, row in enumerate(rows):
        left.setdefault(row.seq, []).append((index, row))
    calls: list[Call] = []
    while left:
        # Every sequence takes ``take`` rows (a lone row and its throwaway count as two); one
        # that would keep a single row for later waits for a later call instead.
        take = min(max(2, len(queue)) for queue in left.values())
        group = [s for s, queue in left.items() if len(queue) == 1 or len(queue) - take != 1]
        per_call = max(1, n_batch // take)
        for begin in range(0, len(group), per_call):
            calls.append(_call(left, group[begin : begin + per_call], take))
        left = {s: queue for s, queue in left.items() if queue}
    return calls


def _call(left: dict[int, list[tuple[int, Row]]], seqs: list[int], take: int) -> Call:
    rows: list[Row] = []
    origin: list[int] = []  # each row's index in the planned rows (-1: a throwaway)
    padded: list[tuple[int, int]] = []
    for seq in seqs:
        queue = left[seq]
        mine, left[seq] = queue[:take], queue[take:]
        for index, row in mine:
            rows.append(row)
            origin.append(index)
        if len(mine) == 1:
            _, row = mine[0]
            rows.append(Row(seq, row.pos + 1, row.token, False))
            origin.append(-1)
            padded.append((seq, row.pos + 1))
    wanted = [(at, i) for at, (i, row) in enumerate(zip(origin, rows, strict=True)) if row.logits]
    return Call(rows, wanted, padded)
