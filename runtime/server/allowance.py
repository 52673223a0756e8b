"""How many requests one key may have running and waiting: its allowance.

``enter`` gives a request a ``Ticket``: a running slot at once, a place in the key's queue, or
nothing (the key is at its limit: the server answers 429). ``leave`` gives the ticket back on
every exit, whichever state it is in: a running slot passes straight to the first waiter (first
come, first served), a waiting ticket leaves the queue. Pure bookkeeping with no I/O, so the gate
(gate.py) owns every await and every cancellation.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import anyio

from runtime.errors import InvalidConfig


@dataclass(frozen=True)
class PerKeyLimits:
    """``max_concurrent`` requests of one key run at once and ``max_queued`` more wait for one
    of them to end; beyond that its requests are refused. Raises ``InvalidConfig`` when
    ``max_concurrent`` is under 1 or ``max_queued`` under 0."""

    max_concurrent: int
    max_queued: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise InvalidConfig(
                f"max_concurrent_per_key must be at least 1 (got {self.max_concurrent}); "
                "leave it unset for no limit"
            )
        if self.max_queued < 0:
            raise InvalidConfig(
                f"max_queued_per_key must be 0 or more (got {self.max_queued}); 0: a request "
                "over the concurrent limit is refused at once"
            )


class Ticket:
    """One request's claim on its key's allowance; ``turn`` is set once it may run."""

    __slots__ = ("granted", "left", "turn")

    def __init__(self) -> None:
        self.granted = False
        self.left = False
        self.turn = anyio.Event()

    def grant(self) -> None:
        self.granted = True
        self.turn.set()


@dataclass(frozen=True)
class AllowanceStatistics:
    """A key's requests running and waiting, at one moment."""

    running: int
    waiting: int


class Allowance:
    """One key's running and waiting requests, within its ``PerKeyLimits``."""

    def __init__(self, limits: PerKeyLimits) -> None:
        self._limits = limits
        self._running = 0
        self._queue: deque[Ticket] = deque()

    def enter(self) -> Ticket | None:
        """A ticket, granted at once if a slot is free, else queued; None when the queue is full
        too (nothing was taken)."""
        ticket = Ticket()
        if self._running < self._limits.max_concurrent:
            self._running += 1
            ticket.grant()
        elif len(self._queue) < self._limits.max_queued:
            self._queue.append(ticket)
        else:
            return None
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Give ``ticket`` back (once; a second call does nothing): its slot passes to the
        first waiter, or its place in the queue is freed."""
        if ticket.left:
            return
        ticket.left = True
        if not ticket.granted:
            self._queue.remove(ticket)
        elif self._queue:
            self._queue.popleft().grant()  # the slot changes hands: running stays the same
        else:
            self._running -= 1

    @property
    def idle(self) -> bool:
        return self._running == 0 and not self._queue

    def statistics(self) -> AllowanceStatistics:
        return AllowanceStatistics(running=self._running, waiting=len(self._queue))


class Allowances:
    """Every key's ``Allowance`` under one ``PerKeyLimits``: made at a key's first request,
    dropped once it has nothing running or waiting (so idle keys cost nothing)."""

    def __init__(self, limits: PerKeyLimits) -> None:
        self.limits = limits
        self._by_tenant: dict[str, Allowance] = {}

    def enter(self, tenant: str) -> Ticket | None:
        """``Allowance.enter`` for ``tenant``'s allowance."""
        allowance = self._by_tenant.get(tenant)
        if allowance is None:
            allowance = self._by_tenant[tenant] = Allowance(self.limits)
        return allowance.enter()

    def leave(self, tenant: str, ticket: Ticket) -> None:
        """``Allowance.leave`` for ``tenant``'s allowance."""
        if ticket.left:
            return  # its allowance may be gone already
        allowance = self._by_tenant[tenant]
        allowance.leave(ticket)
        if allowance.idle:
            del self._by_tenant[tenant]

    def statistics(self) -> dict[str, AllowanceStatistics]:
        """Each busy key's requests running and waiting, by tenant id (``""`` without keys)."""
        return {tenant: allowance.statistics() for tenant, allowance in self._by_tenant.items()}
