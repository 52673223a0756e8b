"""A key's allowance (runtime/server/allowance.py) against a model of what it promises.

Requests enter and leave in any order, each leaving at most once whatever state it is in
(running, queued, refused never entered). The model: at most ``max_concurrent`` run and
``max_queued`` wait; a request is refused only when both are full; a freed slot goes to the
longest waiter; and once every request has left, the key holds nothing.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.server.allowance import Allowances, AllowanceStatistics, PerKeyLimits, Ticket

KEYS = ("alice", "bob")


class AllowanceMachine(RuleBasedStateMachine):
    @initialize(concurrent=st.integers(1, 3), queued=st.integers(0, 3))
    def start(self, concurrent: int, queued: int) -> None:
        self.limits = PerKeyLimits(concurrent, queued)
        self.allowances = Allowances(self.limits)
        self.running: dict[str, list[Ticket]] = {key: [] for key in KEYS}
        self.waiting: dict[str, list[Ticket]] = {key: [] for key in KEYS}

    @rule(key=st.sampled_from(KEYS))
    def enter(self, key: str) -> None:
        full = len(self.running[key]) == self.limits.max_concurrent
        queue_full = len(self.waiting[key]) == self.limits.max_queued
        ticket = self.allowances.enter(key)
        if full and queue_full:
            assert ticket is None
        elif full:
            assert ticket is not None and not ticket.granted
            self.waiting[key].append(ticket)
        else:
            assert ticket is not None and ticket.granted and ticket.turn.is_set()
            self.running[key].append(ticket)

    @precondition(lambda self: any(self.running.values()))
    @rule(data=st.data())
    def a_running_request_ends(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for k in KEYS if self.running[k]]))
        ticket = data.draw(st.sampled_from(self.running[key]))
        self.allowances.leave(key, ticket)
        self.allowances.leave(key, ticket)  # a second time changes nothing
        self.running[key].remove(ticket)
        if self.waiting[key]:  # the longest waiter runs
            first = self.waiting[key].pop(0)
            assert first.granted and first.turn.is_set()
            self.running[key].append(first)

    @precondition(lambda self: any(self.waiting.values()))
    @rule(data=st.data())
    def a_waiting_client_leaves(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k for k in KEYS if self.waiting[k]]))
        ticket = data.draw(st.sampled_from(self.waiting[key]))
        self.allowances.leave(key, ticket)
        self.waiting[key].remove(ticket)
        assert not ticket.granted

    @invariant()
    def the_counts_are_the_models(self) -> None:
        expected = {
            key: AllowanceStatistics(len(self.running[key]), len(self.waiting[key]))
            for key in KEYS
            if self.running[key] or self.waiting[key]
        }
        assert self.allowances.statistics() == expected
        for key in KEYS:
            assert len(self.running[key]) <= self.limits.max_concurrent
            assert len(self.waiting[key]) <= self.limits.max_queued
            assert all(not t.granted for t in self.waiting[key])


TestAllowance = AllowanceMachine.TestCase
