"""The engine process's outbox (runtime/cluster/outbox.py), without Ray: a sequence's token
events merge only across other sequences' tokens, never across any other message, and what
comes out decodes to the same messages in the same order per destination."""

from __future__ import annotations

from runtime.cluster.outbox import Outbox
from runtime.messages import (
    Release,
    SequenceFinished,
    TokenLogprob,
    TokensProduced,
    Usage,
    decode,
)
from runtime.messages.kv_budget import Holder, HolderKind


def tokens(seq: int, *ids: int) -> TokensProduced:
    return TokensProduced(sequence_id=seq, epoch=1, token_ids=ids, text="".join(map(str, ids)))


def taken(outbox: Outbox) -> list[tuple[str, object]]:
    return [(to, decode(data)) for to, data in outbox.take()]


def test_tokens_of_interleaved_streams_merge_per_sequence_in_order() -> None:
    outbox = Outbox()
    for step in range(3):
        outbox.put("router", tokens(1, 10 + step))
        outbox.put("router", tokens(2, 20 + step))
    assert taken(outbox) == [("router", tokens(1, 10, 11, 12)), ("router", tokens(2, 20, 21, 22))]
    assert outbox.merged == 4
    assert taken(outbox) == []


def test_no_token_moves_across_another_message() -> None:
    outbox = Outbox()
    finished = SequenceFinished(sequence_id=2, epoch=1, reason="length", usage=Usage())
    release = Release(holder=Holder(model="m", epoch=1, kind=HolderKind.SEQUENCE, id=2), nbytes=0)
    outbox.put("router", tokens(1, 1))
    outbox.put("kv", release)
    outbox.put("router", tokens(1, 2))
    outbox.put("router", finished)
    outbox.put("router", tokens(1, 3))
    assert taken(outbox) == [
        ("router", tokens(1, 1)),
        ("kv", release),
        ("router", tokens(1, 2)),
        ("router", finished),
        ("router", tokens(1, 3)),
    ]


def test_logprobs_merge_with_their_tokens() -> None:
    outbox = Outbox()
    first = TokenLogprob(token=1, logprob=-0.5)
    then = TokenLogprob(token=2, logprob=-1.5)
    outbox.put("router", TokensProduced(sequence_id=1, epoch=1, token_ids=(1,), text="a",
                                        logprobs=(first,)))  # fmt: skip
    outbox.put("router", TokensProduced(sequence_id=1, epoch=1, token_ids=(2,), text="b",
                                        logprobs=(then,)))  # fmt: skip
    [(_, merged)] = taken(outbox)
    assert merged == TokensProduced(sequence_id=1, epoch=1, token_ids=(1, 2), text="ab",
                                    logprobs=(first, then))  # fmt: skip
