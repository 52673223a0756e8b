"""Examples of token coalescing driven by an explicit clock."""

from __future__ import annotations

import msgspec
import pytest

from runtime.errors import InvalidRequest
from runtime.text.coalesce import Chunk, CoalescePolicy, Coalescer

POLICY = CoalescePolicy(max_chars=8, max_age_s=0.05)


def started(policy: CoalescePolicy = POLICY) -> Coalescer:
    """A coalescer past its stream's first text (which it sends at once, for the TTFT)."""
    coalescer = Coalescer(policy)
    assert coalescer.add(">", [0], now=0.0) == Chunk(">", (0,))
    assert coalescer.next_deadline() is None
    return coalescer


def test_the_first_text_is_sent_at_once_then_text_is_buffered() -> None:
    coalescer = Coalescer(POLICY)

    assert coalescer.add("", [1], now=0.0) is None  # no text yet: nothing a client can show
    assert coalescer.add("Hi", [2], now=0.001) == Chunk("Hi", (1, 2))
    assert coalescer.add("!", [3], now=0.002) is None


def test_buffer_is_flushed_when_it_reaches_max_chars() -> None:
    coalescer = started()

    assert coalescer.add("Hel", [1], now=0.0) is None
    assert coalescer.add("lo ", [2], now=0.01) is None
    chunk = coalescer.add("wo", [3], now=0.02)

    assert chunk == Chunk("Hello wo", (1, 2, 3))
    assert coalescer.next_deadline() is None
    assert coalescer.flush() is None


def test_text_that_would_overflow_starts_the_next_chunk() -> None:
    coalescer = started()
    coalescer.add("Hello", [1], now=0.0)

    chunk = coalescer.add(" world", [2], now=0.01)

    assert chunk == Chunk("Hello", (1,))
    assert coalescer.flush() == Chunk(" world", (2,))


def test_single_add_longer_than_max_chars_is_sent_whole_with_what_preceded_it() -> None:
    coalescer = started()
    coalescer.add("a", [1], now=0.0)

    chunk = coalescer.add("0123456789", [2], now=0.01)

    assert chunk == Chunk("a0123456789", (1, 2))
    assert coalescer.flush() is None


def test_age_flush_happens_from_the_timer_without_a_new_token() -> None:
    coalescer = started()
    assert coalescer.next_deadline() is None
    coalescer.add("Hi", [1], now=1.0)
    coalescer.add("!", [2], now=1.03)  # a later token does not push the deadline back

    deadline = coalescer.next_deadline()

    assert deadline == pytest.approx(1.05)
    assert deadline is not None
    assert coalescer.due(deadline - 0.001) is None
    assert coalescer.due(deadline) == Chunk("Hi!", (1, 2))
    assert coalescer.next_deadline() is None
    assert coalescer.due(deadline + 1.0) is None


def test_token_arriving_after_the_deadline_is_sent_with_the_overdue_text() -> None:
    coalescer = started()
    coalescer.add("a", [1], now=0.0)

    assert coalescer.add("b", [2], now=0.2) == Chunk("ab", (1, 2))


def test_flush_before_a_non_token_event_empties_the_buffer() -> None:
    coalescer = started()
    coalescer.add("par", [1], now=0.0)
    coalescer.add("tial", [2], now=0.001)

    # The caller sends this before e.g. a Finished event, so no text can trail it.
    assert coalescer.flush() == Chunk("partial", (1, 2))
    assert coalescer.flush() is None
    assert coalescer.next_deadline() is None


def test_disabled_policy_gives_one_chunk_per_token() -> None:
    coalescer = Coalescer(CoalescePolicy(enabled=False))

    chunks = [coalescer.add(text, [i], now=0.0) for i, text in enumerate(["a", "", "bc"])]

    assert chunks == [Chunk("a", (0,)), Chunk("", (1,)), Chunk("bc", (2,))]
    assert coalescer.next_deadline() is None
    assert coalescer.flush() is None


def test_tokens_without_text_are_kept_and_start_the_clock() -> None:
    # A token that ends mid-character decodes to "" but its id must still reach the client.
    coalescer = started()

    assert coalescer.add("", [7], now=0.0) is None
    assert coalescer.next_deadline() == pytest.approx(0.05)
    assert coalescer.add("é", [8, 9], now=0.01) is None
    assert coalescer.flush() == Chunk("é", (7, 8, 9))


def test_chunks_keep_all_text_and_ids_in_order_without_duplicates() -> None:
    coalescer = started()
    pieces = ["The", " quick", " brown", " fox", " jumps", "!"]
    chunks: list[Chunk] = []

    for i, piece in enumerate(pieces):
        now = i * 0.02
        for chunk in (coalescer.due(now), coalescer.add(piece, [i], now)):
            if chunk is not None:
                chunks.append(chunk)
    final = coalescer.flush()
    if final is not None:
        chunks.append(final)

    assert "".join(c.text for c in chunks) == "".join(pieces)
    assert [i for c in chunks for i in c.token_ids] == list(range(len(pieces)))
    assert len(chunks) < len(pieces)


def test_policy_out_of_range_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="max_chars"):
        CoalescePolicy(max_chars=0)
    with pytest.raises(InvalidRequest, match="max_age_s"):
        CoalescePolicy(max_age_s=-0.1)


def test_policy_decodes_strictly_from_json() -> None:
    decoded = msgspec.json.decode(b'{"max_chars": 4}', type=CoalescePolicy)

    assert decoded == CoalescePolicy(max_chars=4)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"max_chars": 4, "nope": 1}', type=CoalescePolicy)
    with pytest.raises(msgspec.ValidationError, match="max_chars"):
        msgspec.json.decode(b'{"max_chars": 0}', type=CoalescePolicy)
