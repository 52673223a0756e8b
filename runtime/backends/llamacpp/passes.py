"""How the rows of one decode become ``llama_decode`` calls so that no token's result depends
on which call computed it.

llama.cpp's CPU matrix multiply takes one of two kernels by the number of columns: a pass in which
a sequence has a single row (a decode step) goes through the vector kernels, a pass with two or
more through llamafile's tiled ones, and the two sum in another order. That shows in attention,
which multiplies per sequence: a token decoded alone gets other keys, values and logits (0.2-0.8
apart on SmolLM2) than the same token inside a prompt, so a conversation's second turn, which
reuses the first turn's reply, would differ from the same turn run cold.

So with ``exact_reuse`` (a model option), where the build has llamafile's kernels
(``llama_print_system_info`` says ``LLAMAFILE = 1``), a sequence never has one row in a pass: a
lone row gets a throwaway row of the same sequence one position on (the same token, no logits, its
cell removed after the call). And because llama.cpp splits a pass over several sequences into
sub-passes of equal rows per sequence, the rows are planned into calls that already are: every
sequence in a call has the same number of rows, two or more, so llama.cpp never leaves a sequence
a row of its own. A build without llamafile's kernels (``GGML_LLAMAFILE=OFF``) multiplies every
shape alike and needs none of this.

The cost is the throwaway's compute: 1.83x a B=1 decode step on SmolLM2, 1.5-1.6x a step of 4 or 8
(measured in-process, 1 thread). And it makes SmolLM2 exact, not Gemma 3: its Q5_0/Q8_0 weights
go through llamafile's tiled kernels, whose sums depend on the pass's row count even for two rows
or more (a 302-token prompt in one pass and split 300 + 2 differ by 0.003 in the logits), and
even a build without them differs by the split (docs/models.md).
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
