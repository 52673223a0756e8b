"""The proxy's inbox (runtime/cluster/inbox.py), without Ray: a sequence's KV grant waits for its
lookup's answer when its ``Reserve`` carried the lookup, and both cross in one call; whatever
the proxy is sent, the engine gets every message once, in the order the proxy got them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from runtime.cluster.inbox import Inbox
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, ROUTER
from runtime.kernel.stats import Counters
from runtime.messages import (
    Abort,
    Holder,
    HolderKind,
    Lookup,
    LookupResult,
    Message,
    Release,
    ReservationRefused,
    Reserve,
    Reserved,
    ReusePath,
    decode,
)


def holder(seq: int, kind: HolderKind = HolderKind.SEQUENCE) -> Holder:
    return Holder(model="m", epoch=1, kind=kind, id=seq)


def reserve(seq: int, with_lookup: bool = True) -> Reserve:
    lookup = Lookup(model="m", epoch=1, namespace="", tokens=(1, 2), sequence_id=seq)
    return Reserve(holder=holder(seq), nbytes=64, then_lookup=lookup if with_lookup else None)


def granted(seq: int) -> Reserved:
    return Reserved(holder=holder(seq), nbytes=64)


def answer(seq: int) -> LookupResult:
    return LookupResult(sequence_id=seq, epoch=1, entry_id=None, matched=0, path=ReusePath.MISS,
                        lease_id=None, generation=0)  # fmt: skip


def calls(inbox: Inbox, mail: list[tuple[str, Message]]) -> list[list[Message]]:
    """The calls the proxy makes for ``mail``, each as its decoded messages."""
    out = [inbox.put(sender, message) for sender, message in mail]
    return [[decode(data) for _, data in call] for call in out if call]


def test_a_grant_waits_for_its_lookups_answer_and_both_cross_in_one_call() -> None:
    counters = Counters()
    inbox = Inbox(counters)
    inbox.sent_by_engine(reserve(7))
    admitted = calls(inbox, [(KV_KEEPER, granted(7)), (PREFIX_CACHE, answer(7))])
    assert admitted == [[granted(7), answer(7)]]
    assert counters["transport_grants_held"] == 1 and len(inbox) == 0


def test_mail_after_a_held_grant_waits_with_it_in_order() -> None:
    inbox = Inbox(Counters())
    inbox.sent_by_engine(reserve(7))
    abort = Abort(sequence_id=7, epoch=1)
    mail = [(KV_KEEPER, granted(7)), (ROUTER, abort), (PREFIX_CACHE, answer(7))]
    assert calls(inbox, mail) == [[granted(7), abort, answer(7)]]


def test_grants_of_two_sequences_wait_for_both_answers() -> None:
    inbox = Inbox(Counters())
    inbox.sent_by_engine(reserve(1))
    inbox.sent_by_engine(reserve(2))
    mail = [(KV_KEEPER, granted(1)), (KV_KEEPER, granted(2)), (PREFIX_CACHE, answer(1)),
            (PREFIX_CACHE, answer(2)), (ROUTER, Abort(sequence_id=1, epoch=1))]  # fmt: skip
    assert calls(inbox, mail) == [
        [granted(1), granted(2), answer(1), answer(2)],
        [Abort(sequence_id=1, epoch=1)],
    ]


def test_a_grant_no_lookup_follows_goes_at_once() -> None:
    inbox = Inbox(Counters())
    inbox.sent_by_engine(reserve(1, with_lookup=False))  # e.g. reuse_prefix=False: no lookup
    inbox.sent_by_engine(reserve(2))
    inbox.sent_by_engine(Release(holder=holder(2)))  # given up while it waited
    inbox.sent_by_engine(reserve(3))
    padding = holder(4, HolderKind.BATCH_PADDING)
    refused = ReservationRefused(holder=holder(3), nbytes=64, code="kv_budget_exhausted",
                                 message="busy", retryable=True)  # fmt: skip
    mail = [(KV_KEEPER, granted(1)), (KV_KEEPER, granted(2)), (KV_KEEPER, refused),
            (KV_KEEPER, Reserved(holder=padding, nbytes=8))]  # fmt: skip
    assert calls(inbox, mail) == [[message] for _, message in mail]
    assert calls(inbox, [(KV_KEEPER, granted(3))]) == [[granted(3)]]  # refused: no answer owed


def test_with_the_merge_off_every_message_crosses_alone() -> None:
    inbox = Inbox(Counters(), grant_with_lookup=False)
    inbox.sent_by_engine(reserve(7))
    mail = [(KV_KEEPER, granted(7)), (PREFIX_CACHE, answer(7))]
    assert calls(inbox, mail) == [[granted(7)], [answer(7)]]


def test_a_grant_whose_answer_never_comes_goes_on_at_the_next_collection() -> None:
    counters = Counters()
    inbox = Inbox(counters)
    inbox.sent_by_engine(reserve(7))
    assert calls(inbox, [(KV_KEEPER, granted(7))]) == []
    assert [decode(data) for _, data in inbox.take()] == [granted(7)]
    assert counters["transport_grants_sent_unanswered"] == 1
    assert calls(inbox, [(PREFIX_CACHE, answer(7))]) == [[answer(7)]]  # late: on its own
    assert inbox.take() == []


KINDS = ("reserve", "reserve_plain", "grant", "answer", "abort", "take")
EVENTS = st.lists(st.tuples(st.sampled_from(KINDS), st.integers(1, 3)), max_size=40)


@given(EVENTS)
def test_the_engine_gets_every_message_once_in_the_order_the_proxy_got_them(
    events: list[tuple[str, int]],
) -> None:
    inbox = Inbox(Counters())
    sent: list[Message] = []
    crossed: list[Message] = []
    for kind, seq in events:
        if kind.startswith("reserve"):
            inbox.sent_by_engine(reserve(seq, with_lookup=kind == "reserve"))
            continue
        if kind == "take":
            call = inbox.take()
        else:
            message = granted(seq) if kind == "grant" else answer(seq)
            if kind == "abort":
                message = Abort(sequence_id=seq, epoch=1)
            sent.append(message)
            call = inbox.put(ROUTER, message)
        crossed += [decode(data) for _, data in call]
    crossed += [decode(data) for _, data in inbox.take()]
    assert crossed == sent
