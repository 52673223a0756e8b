"""How a decode's rows become llama_decode calls (runtime/backends/llamacpp/passes.py), for any
mix of sequences and row counts: what makes a token's result independent of the call it is in.

Invariants, with padding: every row is in exactly one call, each sequence's rows in position
order; every call holds at most ``n_batch`` rows, and every sequence in it the same number, two
or more (a lone row plus one throwaway right after it, which keeps no logits); the logits come
back in the order of the rows that asked. Without padding: the rows as they are, one call.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime.backends.llamacpp.passes import Row, plan_calls


@st.composite
def decodes(draw: st.DrawFn) -> tuple[list[Row], int]:
    n_batch = draw(st.integers(2, 64))
    counts = draw(st.lists(st.integers(1, 12), min_size=1, max_size=8))
    rows: list[Row] = []
    for seq, count in enumerate(counts):
        start = draw(st.integers(0, 100))
        for pos in range(start, start + count):
            rows.append(Row(seq, pos, draw(st.integers(0, 1000)), draw(st.booleans())))
    rows = rows[:n_batch]  # callers never hand over more than n_batch rows
    if draw(st.booleans()):  # rows of several sequences interleaved (a decode batch's order)
        rows.sort(key=lambda row: (row.pos, row.seq))
    return rows, n_batch


@given(decodes())
def test_padded_calls_give_each_sequence_equal_rows_of_two_or_more(
    decode: tuple[list[Row], int],
) -> None:
    rows, n_batch = decode
    calls = plan_calls(rows, n_batch, pad=True)
    real: list[Row] = []
    got_logits: list[int] = []
    for call in calls:
        assert len(call.rows) <= n_batch
        per_seq: dict[int, list[Row]] = {}
        for row in call.rows:
            per_seq.setdefault(row.seq, []).append(row)
        assert len({len(mine) for mine in per_seq.values()}) == 1, call.rows
        assert all(len(mine) >= 2 for mine in per_seq.values()), call.rows
        throwaways = {(seq, pos) for seq, pos in call.padded}
        for seq, mine in per_seq.items():
            positions = [row.pos for row in mine]
            assert positions == list(range(positions[0], positions[0] + len(mine)))
            for row in mine:
                if (seq, row.pos) in throwaways:
                    assert not row.logits and row.pos == positions[-1]
                else:
                    real.append(row)
        for at, index in call.logits_at:
            assert call.rows[at] == rows[index] and rows[index].logits
            got_logits.append(index)
    assert sorted(real, key=rows.index) == rows
    for seq in {row.seq for row in rows}:  # each sequence's rows go in position order
        seen = [row.pos for row in real if row.seq == seq]
        assert seen == sorted(seen)
    assert sorted(got_logits) == [i for i, row in enumerate(rows) if row.logits]


@given(decodes())
def test_unpadded_rows_go_as_they_are(decode: tuple[list[Row], int]) -> None:
    rows, n_batch = decode
    [call] = plan_calls(rows, n_batch, pad=False)
    assert call.rows == rows and call.padded == []
    assert [index for _, index in call.logits_at] == [i for i, r in enumerate(rows) if r.logits]
