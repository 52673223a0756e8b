"""The KV budget keeper checked against a simple model: a dict of holdings and a FIFO list.

Rules send the keeper random reservations, releases (whole or partial), transfers and epoch
releases, and advance the virtual clock (delivering due deadline timers as a transport would).
After every step the keeper must conserve bytes, agree with the model, and have answered every
reservation exactly once by its deadline, in FIFO order. Settings come from the active Hypothesis
profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.kv_budget import KVBudgetCore, QueuedReservation
from runtime.errors import InvalidRequest, KVBudgetExhausted, KVRequestTooLarge
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, Address, engine_address
from runtime.messages import (
    EpochReleased,
    Evict,
    GetStats,
    Holder,
    HolderKind,
    Message,
    Release,
    ReleaseEpoch,
    ReservationRefused,
    Reserve,
    Reserved,
    Stats,
    Transfer,
)
from runtime.testing.recording import RecordingContext

BUDGET = 1000
DEFAULT_TIMEOUT_S = 30.0
MODELS = ("a", "b")
SLOTS = ((HolderKind.SEQUENCE, 0), (HolderKind.SEQUENCE, 1), (HolderKind.PREFIX_ENTRY, 0))

# (model, slot, age): age 0 names the model's current epoch, 1 the one before (often stale).
HolderPick = tuple[str, tuple[HolderKind, int], int]
holder_picks = st.tuples(
    st.sampled_from(MODELS), st.sampled_from(SLOTS), st.sampled_from((0, 0, 0, 1))
)
# Half small sizes (so the budget is contended), half anything: 0, the budget, over it, negative.
sizes = st.one_of(st.integers(1, 500), st.integers(-1, BUDGET + 200))
timeouts = st.one_of(st.none(), st.just(0.0), st.integers(1, 50).map(float))

# A reply as the test compares it: (kind, code or None, holder, nbytes).
Reply = tuple[str, str | None, Holder, int]


@dataclass(frozen=True)
class ModelRequest:
    number: int
    requester: Address
    holder: Holder
    nbytes: int
    deadline: float


def requester_of(number: int) -> Address:
    return f"engine-{number}"


def number_of(requester: Address) -> int:
    return int(requester.removeprefix("engine-"))


class KVBudgetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = RecordingContext(KV_KEEPER)
        self.keeper = KVBudgetCore(BUDGET, default_timeout_s=DEFAULT_TIMEOUT_S)
        # The model.
        self.holdings: dict[Holder, int] = {}
        self.waiting: list[ModelRequest] = []
        self.retired: dict[str, int] = {}
        self.current_epoch = dict.fromkeys(MODELS, 1)
        self.expected_replies: dict[Address, list[Reply]] = {}
        self.expected_evicts: list[int] = []
        # What the keeper actually did.
        self.replies: dict[Address, list[Reply]] = {}
        self.evicts: list[int] = []
        self.pinned_evicts = 0
        self.epochs_released: list[tuple[str, str, int]] = []
        self.granted_numbers: list[int] = []
        # Requests that were queued (deadline) and those dropped unanswered by a release.
        self.queued_deadlines: dict[Address, float] = {}
        self.dropped: set[Address] = set()
        self.requests = 0

    # ------------------------------------------------------------------ driving the keeper

    def deliver(self, message: Message, sender: Address) -> None:
        self.keeper.handle(message, sender, self.ctx)
        self.deliver_due_timers()

    def deliver_due_timers(self) -> None:
        for timer in self.ctx.due_timers():
            self.keeper.handle(timer, KV_KEEPER, self.ctx)
        self.model_expire_due()
        self.collect_sent()

    def collect_sent(self) -> None:
        for to, message in self.ctx.take_sent():
            match message:
                case Evict(nbytes=nbytes, include_pinned=True):
                    assert to == PREFIX_CACHE
                    assert nbytes > 0  # only sent while a reservation still waits
                    self.pinned_evicts += 1
                case Evict(nbytes=nbytes):
                    assert to == PREFIX_CACHE
                    self.evicts.append(nbytes)
                case Reserved(holder=holder, nbytes=nbytes):
                    self.replies.setdefault(to, []).append(("reserved", None, holder, nbytes))
                    self.granted_numbers.append(number_of(to))
                case ReservationRefused(holder=holder, nbytes=nbytes, code=code):
                    assert message.retryable == (code == KVBudgetExhausted.code)
                    self.replies.setdefault(to, []).append(("refused", code, holder, nbytes))
                case EpochReleased(model=model, epoch=epoch):
                    self.epochs_released.append((to, model, epoch))
                case _:
                    raise AssertionError(f"unexpected {message!r} to {to}")

    # ------------------------------------------------------------------ the model

    @property
    def model_free(self) -> int:
        return BUDGET - sum(self.holdings.values())

    def holder(self, pick: HolderPick) -> Holder:
        model, (kind, holder_id), age = pick
        epoch = max(self.current_epoch[model] - age, 1)
        return Holder(model=model, epoch=epoch, kind=kind, id=holder_id)

    def is_retired(self, holder: Holder) -> bool:
        return holder.epoch <= self.retired.get(holder.model, 0)

    def model_grant(self, requester: Address, holder: Holder, nbytes: int) -> None:
        self.holdings[holder] = self.holdings.get(holder, 0) + nbytes
        self.expected_replies[requester] = [("reserved", None, holder, nbytes)]

    def model_refuse(self, requester: Address, holder: Holder, nbytes: int, code: str) -> None:
        self.expected_replies[requester] = [("refused", code, holder, nbytes)]

    def model_grant_waiting(self, ask_again: bool = True) -> None:
        while self.waiting and self.waiting[0].nbytes <= self.model_free:
            head = self.waiting.pop(0)
            self.model_grant(head.requester, head.holder, head.nbytes)
        if ask_again and self.waiting:  # the keeper asks for eviction again for the rest
            self.expected_evicts.append(sum(w.nbytes for w in self.waiting) - self.model_free)

    def model_drop_waiting(self, doomed: list[ModelRequest]) -> None:
        self.waiting = [w for w in self.waiting if w not in doomed]
        self.dropped.update(w.requester for w in doomed)

    def model_expire_due(self) -> None:
        due = sorted(
            (w for w in self.waiting if w.deadline <= self.ctx.clock),
            key=lambda w: (w.deadline, w.number),
        )
        for request in due:
            if request in self.waiting:
                self.waiting.remove(request)
                self.model_refuse(
                    request.requester, request.holder, request.nbytes, KVBudgetExhausted.code
                )
                self.model_grant_waiting()

    # ------------------------------------------------------------------ rules

    @rule(pick=holder_picks, nbytes=sizes, timeout_s=timeouts)
    def reserve(self, pick: HolderPick, nbytes: int, timeout_s: float | None) -> None:
        holder = self.holder(pick)
        self.requests += 1
        requester = requester_of(self.requests)
        self.expected_replies[requester] = []
        if self.is_retired(holder):
            self.dropped.add(requester)
        elif nbytes < 0:
            self.model_refuse(requester, holder, nbytes, InvalidRequest.code)
        elif nbytes > BUDGET:
            self.model_refuse(requester, holder, nbytes, KVRequestTooLarge.code)
        elif not self.waiting and nbytes <= self.model_free:
            self.model_grant(requester, holder, nbytes)
        elif timeout_s == 0:  # only if it fits now: refused at once, never queued
            self.model_refuse(requester, holder, nbytes, KVBudgetExhausted.code)
        else:
            deadline = self.ctx.clock + (DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
            self.waiting.append(ModelRequest(self.requests, requester, holder, nbytes, deadline))
            self.queued_deadlines[requester] = deadline
            self.expected_evicts.append(sum(w.nbytes for w in self.waiting) - self.model_free)
        self.deliver(Reserve(holder=holder, nbytes=nbytes, timeout_s=timeout_s), requester)

    @rule(pick=holder_picks)
    def release(self, pick: HolderPick) -> None:
        holder = self.holder(pick)
        self.model_drop_waiting([w for w in self.waiting if w.holder == holder])
        self.holdings.pop(holder, None)
        self.model_grant_waiting()
        self.deliver(Release(holder=holder), "engine")

    @rule(pick=holder_picks, nbytes=st.integers(-1, 700))
    def release_part(self, pick: HolderPick, nbytes: int) -> None:
        holder = self.holder(pick)
        if nbytes >= 0 and holder in self.holdings:  # the holder and its waiting ones stay
            self.holdings[holder] -= min(nbytes, self.holdings[holder])
            self.model_grant_waiting()
        self.deliver(Release(holder=holder, nbytes=nbytes), "engine")

    @rule(source_pick=holder_picks, recipient_pick=holder_picks, nbytes=st.integers(-1, 700))
    def transfer(self, source_pick: HolderPick, recipient_pick: HolderPick, nbytes: int) -> None:
        source, recipient = self.holder(source_pick), self.holder(recipient_pick)
        if nbytes >= 0 and source in self.holdings and not self.is_retired(recipient):
            moved = min(nbytes, self.holdings[source])
            self.holdings[source] -= moved
            self.holdings[recipient] = self.holdings.get(recipient, 0) + moved
        self.deliver(Transfer(source=source, target=recipient, nbytes=nbytes), "engine")

    @rule(model=st.sampled_from(MODELS), age=st.sampled_from((0, 1)))
    def release_epoch(self, model: str, age: int) -> None:
        epoch = max(self.current_epoch[model] - age, 1)
        if epoch == self.current_epoch[model]:
            self.current_epoch[model] += 1  # the model's next load gets a fresh epoch
        self.retired[model] = max(epoch, self.retired.get(model, 0))
        self.model_drop_waiting(
            [w for w in self.waiting if (w.holder.model, w.holder.epoch) == (model, epoch)]
        )
        for holder in [h for h in self.holdings if (h.model, h.epoch) == (model, epoch)]:
            del self.holdings[holder]
        self.model_grant_waiting()
        engine = engine_address(model, epoch)
        self.deliver(ReleaseEpoch(model=model, epoch=epoch), engine)
        assert self.epochs_released[-1] == (engine, model, epoch)

    @rule(seconds=st.integers(1, 40).map(float))
    def advance_time(self, seconds: float) -> None:
        self.ctx.clock += seconds
        self.deliver_due_timers()

    @precondition(lambda self: bool(self.waiting))
    @rule()
    def advance_past_every_deadline(self) -> None:
        self.ctx.clock = max(w.deadline for w in self.waiting)
        self.deliver_due_timers()
        assert self.keeper.queued() == ()

    @invariant()
    def stats_match_the_model(self) -> None:
        self.keeper.handle(GetStats(), "host", self.ctx)
        [(to, reply)] = self.ctx.take_sent()
        assert to == "host"
        assert isinstance(reply, Stats)
        assert reply.gauges == {
            "budget": BUDGET,
            "reserved": BUDGET - self.model_free,
            "free": self.model_free,
            "queued": len(self.waiting),
            "queued_bytes": sum(w.nbytes for w in self.waiting),
            "holders": len(self.holdings),
        }

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bytes_are_conserved(self) -> None:
        keeper = self.keeper
        assert keeper.free_bytes + keeper.reserved_bytes == BUDGET
        assert 0 <= keeper.reserved_bytes <= BUDGET
        assert sum(keeper.holdings().values()) == keeper.reserved_bytes

    @invariant()
    def holdings_match_the_model(self) -> None:
        assert self.keeper.holdings() == self.holdings

    @invariant()
    def queue_matches_the_model(self) -> None:
        expected = tuple(QueuedReservation(w.holder, w.nbytes, w.deadline) for w in self.waiting)
        assert self.keeper.queued() == expected

    @invariant()
    def nothing_waits_past_its_deadline(self) -> None:
        assert all(q.deadline > self.ctx.clock for q in self.keeper.queued())

    @invariant()
    def the_queue_head_never_fits(self) -> None:
        queued = self.keeper.queued()
        assert not queued or queued[0].nbytes > self.keeper.free_bytes

    @invariant()
    def every_reservation_is_answered_once_as_the_model_says(self) -> None:
        assert self.replies == {k: v for k, v in self.expected_replies.items() if v}
        assert all(len(replies) == 1 for replies in self.replies.values())

    @invariant()
    def queued_reservations_are_answered_by_their_deadline(self) -> None:
        for requester, deadline in self.queued_deadlines.items():
            if deadline <= self.ctx.clock and requester not in self.dropped:
                assert len(self.replies.get(requester, [])) == 1, requester

    @invariant()
    def grants_follow_arrival_order(self) -> None:
        assert self.granted_numbers == sorted(self.granted_numbers)

    @invariant()
    def evictions_ask_for_the_queues_shortfall(self) -> None:
        assert self.evicts == self.expected_evicts
        assert all(nbytes > 0 for nbytes in self.evicts)


TestKVBudgetMachine = KVBudgetMachine.TestCase
