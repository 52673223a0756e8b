"""Example tests of the KV budget keeper's policy, driving its core with a recording context."""

from __future__ import annotations

import msgspec
import pytest

from actors.kv_budget import KVBudgetCore, QueuedReservation
from runtime.backends.mlx.memory import default_kv_budget_bytes
from runtime.errors import InvalidRequest, KVBudgetExhausted, KVRequestTooLarge
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, Address, engine_address
from runtime.messages import (
    EnginePlaced,
    EpochReleased,
    Evict,
    GetStats,
    Holder,
    HolderKind,
    Lookup,
    Message,
    Release,
    ReleaseEpoch,
    ReservationExpired,
    ReservationPressure,
    ReservationRefused,
    Reserve,
    Reserved,
    Stats,
    Transfer,
)
from runtime.testing.recording import RecordingContext

ENGINE: Address = engine_address("m", 1)
OTHER_ENGINE: Address = engine_address("m", 2)  # the next load of the same model


def seq(seq_id: int, *, model: str = "m", epoch: int = 1) -> Holder:
    return Holder(model=model, epoch=epoch, kind=HolderKind.SEQUENCE, id=seq_id)


def entry(entry_id: int, *, model: str = "m", epoch: int = 1) -> Holder:
    return Holder(model=model, epoch=epoch, kind=HolderKind.PREFIX_ENTRY, id=entry_id)


@pytest.fixture
def ctx() -> RecordingContext:
    return RecordingContext(KV_KEEPER)


@pytest.fixture
def keeper() -> KVBudgetCore:
    return KVBudgetCore(budget_bytes=1000, default_timeout_s=30.0)


def reserve(
    keeper: KVBudgetCore,
    ctx: RecordingContext,
    holder: Holder,
    nbytes: int,
    timeout_s: float | None = None,
    sender: Address = ENGINE,
) -> None:
    keeper.handle(Reserve(holder=holder, nbytes=nbytes, timeout_s=timeout_s), sender, ctx)


def advance(keeper: KVBudgetCore, ctx: RecordingContext, seconds: float) -> None:
    """Move the clock and deliver the timers that came due, as a transport would."""
    ctx.clock += seconds
    for timer in ctx.due_timers():
        keeper.handle(timer, KV_KEEPER, ctx)


def assert_conserved(keeper: KVBudgetCore) -> None:
    assert keeper.free_bytes + keeper.reserved_bytes == keeper.budget_bytes
    assert 0 <= keeper.reserved_bytes <= keeper.budget_bytes
    assert sum(keeper.holdings().values()) == keeper.reserved_bytes


def stats(keeper: KVBudgetCore, ctx: RecordingContext) -> Stats:
    keeper.handle(GetStats(), "host", ctx)
    [(to, reply)] = ctx.take_sent()
    assert to == "host"
    assert isinstance(reply, Stats)
    return reply


def only_refusal(sent: list[tuple[Address, Message]]) -> tuple[Address, ReservationRefused]:
    [(to, reply)] = sent
    assert isinstance(reply, ReservationRefused)
    return to, reply


# --------------------------------------------------------------------------- reserve


def test_reserve_that_fits_is_granted_at_once(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 400)

    assert ctx.take_sent() == [(ENGINE, Reserved(holder=seq(1), nbytes=400))]
    assert keeper.holding(seq(1)) == 400
    assert keeper.reserved_bytes == 400
    assert keeper.free_bytes == 600
    assert ctx.timers == []
    assert_conserved(keeper)


def test_reserve_of_exactly_the_free_bytes_is_granted(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 1000)

    assert ctx.take_sent() == [(ENGINE, Reserved(holder=seq(1), nbytes=1000))]
    assert keeper.free_bytes == 0


def test_reservations_of_one_holder_add_up(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 300)
    reserve(keeper, ctx, seq(1), 200)

    assert keeper.holding(seq(1)) == 500
    assert keeper.holdings() == {seq(1): 500}
    assert_conserved(keeper)


def test_holdings_is_a_copy(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 300)
    view = keeper.holdings()
    assert isinstance(view, dict)
    view[seq(1)] = 0

    assert keeper.holding(seq(1)) == 300


def test_reserve_larger_than_budget_is_refused_at_once(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 1001)

    to, refusal = only_refusal(ctx.take_sent())
    assert to == ENGINE
    assert refusal.code == KVRequestTooLarge.code == "kv_request_too_large"
    assert refusal.retryable is False
    assert (refusal.holder, refusal.nbytes) == (seq(1), 1001)
    assert "1001" in refusal.message
    assert "1000" in refusal.message
    assert keeper.queued() == ()
    assert ctx.timers == []
    assert keeper.reserved_bytes == 0


def test_too_large_is_refused_even_while_others_wait(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    reserve(keeper, ctx, seq(2), 500)
    ctx.take_sent()

    reserve(keeper, ctx, seq(3), 5000)

    _, refusal = only_refusal(ctx.take_sent())
    assert refusal.code == KVRequestTooLarge.code
    assert [q.holder for q in keeper.queued()] == [seq(2)]


@pytest.mark.parametrize(("nbytes", "timeout_s"), [(-1, None), (10, -1.0), (10, float("nan"))])
def test_malformed_reserve_is_refused_as_invalid(
    keeper: KVBudgetCore, ctx: RecordingContext, nbytes: int, timeout_s: float | None
) -> None:
    reserve(keeper, ctx, seq(1), nbytes, timeout_s)

    _, refusal = only_refusal(ctx.take_sent())
    assert refusal.code == InvalidRequest.code == "invalid_request"
    assert refusal.retryable is False
    assert keeper.holdings() == {}
    assert keeper.queued() == ()


def test_reserve_that_does_not_fit_queues_asks_eviction_and_sets_deadline(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 700)
    ctx.take_sent()
    ctx.clock = 5.0

    reserve(keeper, ctx, seq(2), 500, timeout_s=2.0)

    assert ctx.take_sent() == [(PREFIX_CACHE, Evict(nbytes=200))]
    assert keeper.queued() == (QueuedReservation(seq(2), 500, 7.0),)
    assert ctx.timers == [
        (7.0, ReservationExpired(holder=seq(2), ticket=1)),
        (6.0, ReservationPressure(holder=seq(2), ticket=1)),  # pinned entries may go after this
    ]
    assert keeper.holding(seq(2)) == 0


def test_default_timeout_applies_when_none_given(ctx: RecordingContext) -> None:
    keeper = KVBudgetCore(budget_bytes=100, default_timeout_s=12.5)
    reserve(keeper, ctx, seq(1), 100)
    reserve(keeper, ctx, seq(2), 1)

    assert keeper.queued() == (QueuedReservation(seq(2), 1, 12.5),)


def test_evict_asks_for_the_whole_queues_shortfall(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 700)
    reserve(keeper, ctx, seq(2), 500)
    ctx.take_sent()

    reserve(keeper, ctx, seq(3), 100)

    # 300 free; 500 + 100 waiting.
    assert ctx.take_sent() == [(PREFIX_CACHE, Evict(nbytes=300))]


def test_small_reserve_does_not_jump_the_queue(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 700)
    reserve(keeper, ctx, seq(2), 500)
    ctx.take_sent()

    reserve(keeper, ctx, seq(3), 10)

    assert [to for to, _ in ctx.take_sent()] == [PREFIX_CACHE]
    assert [q.holder for q in keeper.queued()] == [seq(2), seq(3)]
    assert keeper.holding(seq(3)) == 0


def test_tickets_are_never_reused(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 1000)
    reserve(keeper, ctx, seq(2), 10)  # ticket 1, deadline 30
    keeper.handle(Release(holder=seq(2)), ENGINE, ctx)
    advance(keeper, ctx, 10.0)
    reserve(keeper, ctx, seq(2), 10)  # the same holder again: ticket 2, deadline 40

    advance(keeper, ctx, 20.0)  # ticket 1's timer fires: stale, it does not expire ticket 2

    assert ctx.dead_letters["stale_timer"] == 1
    assert keeper.queued() == (QueuedReservation(seq(2), 10, 40.0),)
    advance(keeper, ctx, 10.0)
    assert keeper.queued() == ()
    assert keeper.counters.snapshot()["refused_timeout"] == 1


def test_however_many_wait_only_the_earliest_deadline_has_timers_pending(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    # A timer cannot be cancelled (on the production transport it is a sleeping task): one pair
    # per queued reservation outlived the reservations by up to 30 s (docs/reliability.md, "Soak").
    reserve(keeper, ctx, seq(0), 1000)
    for i in range(1, 101):
        ctx.clock = i * 0.01
        reserve(keeper, ctx, seq(i), 10)

    assert ctx.timers == [
        (30.01, ReservationExpired(holder=seq(1), ticket=1)),
        (15.01, ReservationPressure(holder=seq(1), ticket=1)),
    ]
    keeper.handle(Release(holder=seq(0)), ENGINE, ctx)  # every waiting reservation is granted
    assert keeper.queued() == () and len(ctx.timers) == 2


def test_a_shorter_timeout_arms_its_own_earlier_deadline(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 1000)
    reserve(keeper, ctx, seq(2), 10)  # deadline 30
    reserve(keeper, ctx, seq(3), 10, timeout_s=4.0)  # deadline 4: ahead of the armed one
    ctx.take_sent()

    advance(keeper, ctx, 4.0)

    assert [type(m) for _, m in ctx.take_sent() if not isinstance(m, Evict)] == [ReservationRefused]
    assert keeper.queued() == (QueuedReservation(seq(2), 10, 30.0),)


def test_the_next_deadline_is_armed_when_the_earliest_was_granted_first(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 1000)
    reserve(keeper, ctx, seq(2), 500, sender="a")  # deadline 30, armed
    ctx.clock = 5.0
    reserve(keeper, ctx, seq(3), 600, sender="b")  # deadline 35, behind it
    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)  # seq(2) fits, seq(3) does not
    ctx.take_sent()

    advance(keeper, ctx, 25.0)  # seq(2)'s timer: stale, and seq(3)'s deadline gets one
    assert [m for _, m in ctx.take_sent() if not isinstance(m, Evict)] == []
    assert len(keeper.queued()) == 1
    advance(keeper, ctx, 5.0)

    sent = [(to, type(m)) for to, m in ctx.take_sent() if not isinstance(m, Evict)]
    assert sent == [("b", ReservationRefused)]
    assert keeper.queued() == ()


# --------------------------------------------------------------------------- release


def test_release_frees_all_bytes_of_the_holder(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 300)
    reserve(keeper, ctx, seq(1), 200)
    reserve(keeper, ctx, seq(2), 100)
    ctx.take_sent()

    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)

    assert keeper.holdings() == {seq(2): 100}
    assert keeper.free_bytes == 900
    assert ctx.take_sent() == []
    assert_conserved(keeper)


def test_release_is_idempotent_and_counts_unknown_holders(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 300)
    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)
    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)
    keeper.handle(Release(holder=seq(9)), ENGINE, ctx)

    assert keeper.reserved_bytes == 0
    assert ctx.dead_letters["released_unknown"] == 2


def test_release_grants_waiting_in_fifo_order_until_one_does_not_fit(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    reserve(keeper, ctx, seq(2), 400, sender="a")
    reserve(keeper, ctx, seq(3), 500, sender="b")
    reserve(keeper, ctx, seq(4), 200, sender="c")
    reserve(keeper, ctx, seq(5), 50, sender="d")
    ctx.take_sent()

    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)

    # 1000 free: 400 and 500 fit; 200 does not (100 left), so 50 waits behind it; the keeper asks
    # again for the rest's shortfall (a finished request usually left an evictable entry).
    assert ctx.take_sent() == [
        ("a", Reserved(holder=seq(2), nbytes=400)),
        ("b", Reserved(holder=seq(3), nbytes=500)),
        (PREFIX_CACHE, Evict(nbytes=150)),
    ]
    assert [q.holder for q in keeper.queued()] == [seq(4), seq(5)]
    assert keeper.free_bytes == 100
    assert_conserved(keeper)


def test_release_while_queued_drops_the_waiting_reservation_silently(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    reserve(keeper, ctx, seq(2), 400, timeout_s=5.0)
    ctx.take_sent()

    keeper.handle(Release(holder=seq(2)), ENGINE, ctx)

    assert keeper.queued() == ()
    assert ctx.take_sent() == []
    assert ctx.dead_letters == {"dropped_waiting": 1}
    # Its deadline timer now finds nothing: a counted no-op, no refusal.
    advance(keeper, ctx, 5.0)
    assert ctx.take_sent() == []
    assert ctx.dead_letters["stale_timer"] == 1


def test_release_of_a_queued_head_grants_the_next(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    reserve(keeper, ctx, seq(2), 400, sender="a")
    reserve(keeper, ctx, seq(3), 100, sender="b")
    ctx.take_sent()

    keeper.handle(Release(holder=seq(2)), ENGINE, ctx)

    assert ctx.take_sent() == [("b", Reserved(holder=seq(3), nbytes=100))]
    assert keeper.queued() == ()


def test_partial_release_frees_that_much_and_keeps_the_holder(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 300)
    reserve(keeper, ctx, seq(2), 100)
    ctx.take_sent()

    keeper.handle(Release(holder=seq(1), nbytes=120), ENGINE, ctx)
    keeper.handle(Release(holder=seq(1), nbytes=180), ENGINE, ctx)

    assert keeper.holdings() == {seq(1): 0, seq(2): 100}  # listed until a full release
    assert keeper.free_bytes == 900
    assert ctx.take_sent() == []
    assert ctx.dead_letters == {}
    assert_conserved(keeper)
    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)
    assert keeper.holdings() == {seq(2): 100}


def test_partial_release_of_more_than_held_is_clamped_and_counted(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 300)

    keeper.handle(Release(holder=seq(1), nbytes=500), ENGINE, ctx)
    keeper.handle(Release(holder=seq(1), nbytes=-1), ENGINE, ctx)
    keeper.handle(Release(holder=seq(9), nbytes=10), ENGINE, ctx)

    assert keeper.holdings() == {seq(1): 0}
    assert keeper.reserved_bytes == 0
    assert ctx.dead_letters == {"release_short": 1, "release_invalid": 1, "released_unknown": 1}
    assert_conserved(keeper)


def test_partial_release_grants_waiting_from_the_head_and_keeps_the_holders_own_waiting(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    reserve(keeper, ctx, seq(1), 300, sender="own")  # the holder's own waiting reservation
    reserve(keeper, ctx, seq(2), 100, sender="b")
    ctx.take_sent()

    keeper.handle(Release(holder=seq(1), nbytes=250), ENGINE, ctx)

    # 350 free: the head (300) fits, then 100 does not; the keeper asks for its shortfall.
    assert ctx.take_sent() == [
        ("own", Reserved(holder=seq(1), nbytes=300)),
        (PREFIX_CACHE, Evict(nbytes=50)),
    ]
    assert keeper.holdings() == {seq(1): 950}
    assert [q.holder for q in keeper.queued()] == [seq(2)]
    assert_conserved(keeper)


# --------------------------------------------------------------------------- deadlines


def test_deadline_refuses_as_retryable_budget_exhausted(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    reserve(keeper, ctx, seq(2), 400, timeout_s=3.0, sender="requester")
    ctx.take_sent()

    advance(keeper, ctx, 2.9)
    # Half-way, the keeper asked again, now letting pinned entries be evicted too.
    assert ctx.take_sent() == [(PREFIX_CACHE, Evict(nbytes=300, include_pinned=True))]
    assert len(keeper.queued()) == 1

    advance(keeper, ctx, 0.1)
    to, refusal = only_refusal(ctx.take_sent())
    assert to == "requester"
    assert refusal.code == KVBudgetExhausted.code == "kv_budget_exhausted"
    assert refusal.retryable is True
    assert (refusal.holder, refusal.nbytes) == (seq(2), 400)
    assert "retry" in refusal.message
    assert keeper.queued() == ()
    assert keeper.holdings() == {seq(1): 900}


def test_expiry_of_the_head_lets_the_next_ones_in(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 600)
    reserve(keeper, ctx, seq(2), 500, timeout_s=1.0, sender="a")
    reserve(keeper, ctx, seq(3), 300, timeout_s=10.0, sender="b")
    ctx.take_sent()

    advance(keeper, ctx, 1.0)

    sent = [(to, m) for to, m in ctx.take_sent() if not isinstance(m, Evict)]
    assert [(to, type(m)) for to, m in sent] == [("a", ReservationRefused), ("b", Reserved)]
    assert keeper.holdings() == {seq(1): 600, seq(3): 300}
    # Only the earliest deadline had a timer; seq(3)'s half-way one later finds it granted.
    advance(keeper, ctx, 20.0)
    assert ctx.take_sent() == []
    assert ctx.timers == []


def test_a_due_reservation_that_an_earlier_expiry_let_in_is_granted_not_expired_again(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    # Found by the dev profile's state machine: the earliest deadline's timer fires once the
    # clock is past two more; the first of those expires and lets the second in, which was still
    # on the list of due ones (a KeyError before).
    reserve(keeper, ctx, seq(1), 600)
    reserve(keeper, ctx, seq(2), 500, timeout_s=1.0, sender="a")
    reserve(keeper, ctx, seq(3), 450, timeout_s=2.0, sender="b")
    reserve(keeper, ctx, seq(4), 300, timeout_s=2.0, sender="c")
    ctx.take_sent()

    advance(keeper, ctx, 2.0)

    sent = [(to, type(m)) for to, m in ctx.take_sent() if not isinstance(m, Evict)]
    assert sent == [("a", ReservationRefused), ("b", ReservationRefused), ("c", Reserved)]
    assert keeper.holdings() == {seq(1): 600, seq(4): 300}
    assert keeper.queued() == ()
    assert_conserved(keeper)


def test_stale_ticket_is_a_counted_no_op(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 100)
    ctx.take_sent()

    keeper.handle(ReservationExpired(holder=seq(1), ticket=42), KV_KEEPER, ctx)

    assert ctx.take_sent() == []
    assert keeper.holdings() == {seq(1): 100}
    assert ctx.dead_letters == {"stale_timer": 1}


def test_expiry_naming_another_holder_is_stale(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 1000)
    reserve(keeper, ctx, seq(2), 100)
    ctx.take_sent()

    keeper.handle(ReservationExpired(holder=seq(3), ticket=1), KV_KEEPER, ctx)

    assert len(keeper.queued()) == 1
    assert ctx.dead_letters == {"stale_timer": 1}


# --------------------------------------------------------------------------- transfer


def test_transfer_moves_bytes_and_conserves_the_total(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 500)
    ctx.take_sent()

    keeper.handle(Transfer(source=seq(1), target=entry(7), nbytes=300), ENGINE, ctx)

    assert keeper.holdings() == {seq(1): 200, entry(7): 300}
    assert keeper.reserved_bytes == 500
    assert ctx.take_sent() == []
    assert_conserved(keeper)


def test_transfer_joins_an_existing_target(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 500)
    reserve(keeper, ctx, entry(7), 100)

    keeper.handle(Transfer(source=seq(1), target=entry(7), nbytes=500), ENGINE, ctx)

    assert keeper.holdings() == {seq(1): 0, entry(7): 600}
    # The emptied source is still a holder, so its later release is not an unknown one.
    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)
    assert ctx.dead_letters["released_unknown"] == 0
    assert keeper.holdings() == {entry(7): 600}


def test_short_transfer_moves_only_what_the_source_holds(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 200)

    keeper.handle(Transfer(source=seq(1), target=entry(7), nbytes=300), ENGINE, ctx)

    assert keeper.holdings() == {seq(1): 0, entry(7): 200}
    assert keeper.reserved_bytes == 200
    assert ctx.dead_letters == {"transfer_short": 1}
    assert_conserved(keeper)


def test_transfer_from_unknown_source_changes_nothing(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    keeper.handle(Transfer(source=seq(1), target=entry(7), nbytes=300), ENGINE, ctx)
    keeper.handle(Transfer(source=seq(1), target=entry(7), nbytes=-1), ENGINE, ctx)

    assert keeper.holdings() == {}
    assert ctx.dead_letters == {"transfer_unknown_source": 1, "transfer_invalid": 1}


# --------------------------------------------------------------------------- release epoch


def test_release_epoch_frees_that_epoch_only_and_drops_its_waiting(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1, epoch=1), 300)
    reserve(keeper, ctx, entry(2, epoch=1), 200)
    reserve(keeper, ctx, seq(1, epoch=2), 100, sender=OTHER_ENGINE)
    reserve(keeper, ctx, seq(1, model="other", epoch=1), 350, sender=engine_address("other", 1))
    reserve(keeper, ctx, seq(3, epoch=1), 400)
    reserve(keeper, ctx, seq(2, epoch=2), 500, sender=OTHER_ENGINE)
    ctx.take_sent()

    keeper.handle(ReleaseEpoch(model="m", epoch=1), ENGINE, ctx)

    assert ctx.take_sent() == [
        (OTHER_ENGINE, Reserved(holder=seq(2, epoch=2), nbytes=500)),
        (ENGINE, EpochReleased(model="m", epoch=1)),
    ]
    assert keeper.holdings() == {
        seq(1, epoch=2): 100,
        seq(1, model="other", epoch=1): 350,
        seq(2, epoch=2): 500,
    }
    assert ctx.dead_letters == {"dropped_waiting": 1}
    assert_conserved(keeper)


def test_after_release_epoch_that_epoch_can_no_longer_reserve(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    keeper.handle(ReleaseEpoch(model="m", epoch=2), OTHER_ENGINE, ctx)
    assert ctx.take_sent() == [(OTHER_ENGINE, EpochReleased(model="m", epoch=2))]

    reserve(keeper, ctx, seq(1, epoch=1), 100)
    reserve(keeper, ctx, seq(1, epoch=2), 100)
    reserve(keeper, ctx, seq(1, epoch=3), 100)

    assert ctx.take_sent() == [(ENGINE, Reserved(holder=seq(1, epoch=3), nbytes=100))]
    assert keeper.holdings() == {seq(1, epoch=3): 100}
    assert ctx.dead_letters == {"stale_epoch": 2}


# --------------------------------------------------------------------------- stats & misc


def test_stats_report_counters_and_gauges(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 600)
    reserve(keeper, ctx, seq(2), 500, timeout_s=1.0)
    reserve(keeper, ctx, seq(3), 450)
    reserve(keeper, ctx, seq(4), 2000)
    keeper.handle(Transfer(source=seq(1), target=entry(1), nbytes=100), ENGINE, ctx)
    advance(keeper, ctx, 1.0)  # seq(2) refused; seq(3) still does not fit
    ctx.take_sent()

    reply = stats(keeper, ctx)

    assert reply.actor == "kv"
    assert reply.gauges == {
        "budget": 1000,
        "reserved": 600,
        "free": 400,
        "queued": 1,
        "queued_bytes": 450,
        "holders": 2,
    }
    counters = reply.counters
    assert counters["granted"] == 1
    assert counters["queued"] == 2
    assert counters["evict_requests"] == 3  # two queueings, and again after the expiry
    assert counters["refused_too_large"] == 1
    assert counters["refused_timeout"] == 1
    assert counters["transfers"] == 1
    assert counters["released"] == 0
    assert counters["stale_timer"] == 0


def test_unexpected_message_is_counted_not_raised(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    keeper.handle(Reserved(holder=seq(1), nbytes=1), ENGINE, ctx)

    assert ctx.dead_letters == {"unexpected_message": 1}
    assert ctx.take_sent() == []


def test_on_stop_sends_nothing(keeper: KVBudgetCore, ctx: RecordingContext) -> None:
    reserve(keeper, ctx, seq(1), 100)
    ctx.take_sent()

    keeper.on_stop(ctx)

    assert ctx.take_sent() == []


def test_constructor_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        KVBudgetCore(budget_bytes=-1)
    with pytest.raises(ValueError, match="default_timeout_s"):
        KVBudgetCore(budget_bytes=1, default_timeout_s=-1.0)


# --------------------------------------------------------------------------- default budget


def test_default_kv_budget_is_a_fraction_of_what_mlx_reports() -> None:
    import mlx.core as mx

    budget = default_kv_budget_bytes()

    assert 0 < budget < mx.get_memory_limit()
    assert default_kv_budget_bytes(0.25) <= budget


def test_default_kv_budget_prefers_the_device_working_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlx.core as mx

    info = {"max_recommended_working_set_size": 8_000, "memory_size": 16_000}
    monkeypatch.setattr(mx, "device_info", lambda: info, raising=False)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 2_000)

    assert default_kv_budget_bytes(0.5) == 3_000


def test_default_kv_budget_falls_back_to_physical_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    import mlx.core as mx

    monkeypatch.setattr(mx, "device_info", dict, raising=False)
    monkeypatch.setattr(mx, "get_memory_limit", lambda: 0)
    monkeypatch.setattr(mx, "get_active_memory", lambda: 0)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    assert default_kv_budget_bytes(1.0) == physical


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_default_kv_budget_rejects_a_bad_fraction(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        default_kv_budget_bytes(fraction)


def test_a_zero_timeout_reservation_is_granted_only_if_it_fits_now(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    ctx.take_sent()
    reserve(keeper, ctx, entry(2), 200, timeout_s=0.0)
    [(_, reply)] = ctx.take_sent()  # refused at once: no Evict, nothing queued
    assert isinstance(reply, ReservationRefused) and reply.retryable
    assert reply.code == "kv_budget_exhausted"
    assert keeper.queued() == () and ctx.timers == []
    reserve(keeper, ctx, entry(3), 100, timeout_s=0.0)
    assert [type(m) for _, m in ctx.take_sent()] == [Reserved]


# --------------------------------------------------------------------------- budgets per node


def placed_keeper(ctx: RecordingContext) -> KVBudgetCore:
    """Host budget 1000; engine m@0#1 on node-a (budget 300 by IP), m@1#1 on node-b (default)."""
    keeper = KVBudgetCore(1000, node_budgets={"10.0.0.1": 300}, node_default_bytes=500)
    for model, node, ip in (("m@0", "node-a", "10.0.0.1"), ("m@1", "node-b", "10.0.0.2")):
        placed = EnginePlaced(model=model, epoch=1, node=node, node_ip=ip)
        keeper.handle(placed, engine_address(model, 1), ctx)
    return keeper


def test_a_reservation_is_checked_against_its_engines_node_budget(ctx: RecordingContext) -> None:
    keeper = placed_keeper(ctx)
    reserve(keeper, ctx, seq(1, model="m@0"), 400)  # over node-a's 300, under the host's 1000
    reserve(keeper, ctx, seq(2, model="m@1"), 400)  # node-b: 500
    reserve(keeper, ctx, seq(3, model="m"), 900)  # the host's own engine

    (_, refused), (_, granted), (_, on_host) = ctx.take_sent()
    assert isinstance(refused, ReservationRefused) and refused.code == KVRequestTooLarge.code
    assert "of its node node-a" in refused.message
    assert isinstance(granted, Reserved) and isinstance(on_host, Reserved)
    assert keeper.nodes() == {"host": (1000, 900), "node-a": (300, 0), "node-b": (500, 400)}
    assert keeper.node_of(seq(2, model="m@1")) == "node-b"


def test_a_full_node_queues_and_evicts_its_own_entries_while_others_are_granted(
    ctx: RecordingContext,
) -> None:
    keeper = placed_keeper(ctx)
    reserve(keeper, ctx, entry(1, model="m@0"), 250)
    reserve(keeper, ctx, entry(1, model="m@1"), 100)
    ctx.take_sent()
    reserve(keeper, ctx, seq(1, model="m@0"), 100)  # node-a has 50 free: it waits
    reserve(keeper, ctx, seq(2, model="m@1"), 100)  # node-b's queue is its own: granted

    (_, evict), (_, granted) = ctx.take_sent()
    assert evict == Evict(nbytes=50, epochs=(("m@0", 1),))  # only node-a's entries free node-a
    assert isinstance(granted, Reserved) and granted.holder == seq(2, model="m@1")
    keeper.handle(Release(holder=entry(1, model="m@0")), ENGINE, ctx)
    assert ctx.take_sent() == [(ENGINE, Reserved(holder=seq(1, model="m@0"), nbytes=100))]

    gauges = stats(keeper, ctx).gauges
    assert gauges["node_budget:node-a"] == 300 and gauges["node_reserved:node-a"] == 100
    assert gauges["node_reserved:node-b"] == 200 and gauges["node_queued:node-b"] == 0
    assert gauges["budget"] == 1800  # the totals add the nodes up


def test_a_lost_engines_epoch_is_released_from_its_node(ctx: RecordingContext) -> None:
    keeper = placed_keeper(ctx)
    reserve(keeper, ctx, seq(1, model="m@0"), 200)
    keeper.handle(Transfer(source=seq(1, model="m@0"), target=entry(5, model="m@0"), nbytes=150),
                  ENGINE, ctx)  # fmt: skip
    assert keeper.node_of(entry(5, model="m@0")) == "node-a"  # an entry stays on its node
    keeper.handle(ReleaseEpoch(model="m@0", epoch=1), ENGINE, ctx)

    assert keeper.nodes()["node-a"] == (300, 0)
    assert not keeper.holdings()


# --------------------------------------------------------------------------- a lookup riding on it


def lookup_of(seq_id: int) -> Lookup:
    return Lookup(model="m", epoch=1, namespace="n", tokens=(1, 2, 3), sequence_id=seq_id)


def test_a_granted_reservation_sends_its_lookup_on_right_after_reserved(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    keeper.handle(Reserve(holder=seq(1), nbytes=100, then_lookup=lookup_of(1)), ENGINE, ctx)

    assert ctx.take_sent() == [
        (ENGINE, Reserved(holder=seq(1), nbytes=100)),
        (PREFIX_CACHE, msgspec.structs.replace(lookup_of(1), reply_to=ENGINE)),
    ]


def test_a_queued_reservation_sends_its_lookup_only_when_granted_never_when_refused(
    keeper: KVBudgetCore, ctx: RecordingContext
) -> None:
    reserve(keeper, ctx, seq(1), 900)
    for seq_id in (2, 3):
        request = Reserve(holder=seq(seq_id), nbytes=600, timeout_s=10.0,
                          then_lookup=lookup_of(seq_id))  # fmt: skip
        keeper.handle(request, ENGINE, ctx)
    ctx.take_sent()  # the grant and the evictions

    keeper.handle(Release(holder=seq(1)), ENGINE, ctx)  # seq(2) fits now; seq(3) does not
    granted = ctx.take_sent()
    assert granted[:2] == [
        (ENGINE, Reserved(holder=seq(2), nbytes=600)),
        (PREFIX_CACHE, msgspec.structs.replace(lookup_of(2), reply_to=ENGINE)),
    ]
    advance(keeper, ctx, 10.0)  # seq(3) is refused at its deadline: no lookup for it
    assert not any(isinstance(m, Lookup) for _, m in ctx.take_sent())
    assert stats(keeper, ctx).counters["lookups_sent_on"] == 1
