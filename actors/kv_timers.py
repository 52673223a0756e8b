"""The KV keeper's queue timers: one ``ReservationExpired`` pending for the earliest deadline in the
queue, and one ``ReservationPressure`` for the earliest half-way point still ahead.

A timer cannot be cancelled, and on the production transport each pending one is a task asleep
until it fires. One pair per queued reservation left thousands asleep long after their
reservations had been granted (the soak found 3,010 after 1,505 queued reservations:
docs/reliability.md, "Soak"). Armed one at a time, the pending timers stay at two whatever the
queue's length (plus one each time a shorter timeout jumps ahead of the armed one).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from runtime.kernel.core import Context
from runtime.messages import Holder, ReservationExpired, ReservationPressure


class Queued(Protocol):
    """A waiting reservation, as far as its timers are concerned."""

    @property
    def ticket(self) -> int: ...
    @property
    def holder(self) -> Holder: ...
    @property
    def deadline(self) -> float: ...
    @property
    def pressure_at(self) -> float: ...


class QueueTimers:
    """Which deadline and which half-way point have a timer pending (their due time, ticket)."""

    def __init__(self) -> None:
        self._expiry: tuple[float, int] | None = None
        self._pressure: tuple[float, int] | None = None

    def arm(self, waiting: Collection[Queued], ctx: Context) -> None:
        """Make sure the earliest deadline of ``waiting``, and its earliest half-way point still
        ahead, each have a timer pending (none is armed when one as early already is)."""
        if not waiting:
            return
        now = ctx.now()
        first = min(waiting, key=lambda w: (w.deadline, w.ticket))
        if self._expiry is None or first.deadline < self._expiry[0]:
            self._expiry = (first.deadline, first.ticket)
            message = ReservationExpired(holder=first.holder, ticket=first.ticket)
            ctx.send_later(max(0.0, first.deadline - now), message)
        ahead = [w for w in waiting if w.pressure_at > now]
        if not ahead:
            return
        press = min(ahead, key=lambda w: (w.pressure_at, w.ticket))
        if self._pressure is None or press.pressure_at < self._pressure[0]:
            self._pressure = (press.pressure_at, press.ticket)
            message_p = ReservationPressure(holder=press.holder, ticket=press.ticket)
            ctx.send_later(press.pressure_at - now, message_p)

    def expiry_fired(self, ticket: int) -> None:
        """A ``ReservationExpired`` came back: if it was the armed one, none is pending now."""
        if self._expiry is not None and self._expiry[1] == ticket:
            self._expiry = None

    def pressure_fired(self, ticket: int) -> None:
        """A ``ReservationPressure`` came back: if it was the armed one, none is pending now."""
        if self._pressure is not None and self._pressure[1] == ticket:
            self._pressure = None
