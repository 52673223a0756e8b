"""The KV keeper's waiting reservations: FIFO per node, by a ticket that is never reused.

A reservation that does not fit its node's free bytes (or arrives while others of its node wait)
waits here until it is granted, dropped (its holder or epoch released) or refused at its deadline.
Each node's queue is FIFO on its own: its head blocks only reservations of the same node
(actors/kv_ledgers.py). The keeper (kv_budget.py) decides; this keeps the order and answers
questions about it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from runtime.kernel.core import Address
from runtime.messages import Holder, Lookup


class QueuedReservation(NamedTuple):
    """A reservation waiting for bytes, as seen from outside the keeper."""

    holder: Holder
    nbytes: int
    deadline: float


@dataclass(frozen=True, slots=True)
class Waiting:
    ticket: int
    holder: Holder
    nbytes: int
    deadline: float
    timeout_s: float
    requester: Address
    pressure_at: float  # half-way to the deadline: pinned entries may be evicted for it from then
    node: str  # whose budget it waits for
    then_lookup: Lookup | None  # sent on once granted


class WaitingQueue:
    """Waiting reservations by ticket; dict order is arrival order (see module docstring)."""

    def __init__(self) -> None:
        self._waiting: dict[int, Waiting] = {}
        self._tickets = itertools.count(1)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, ticket: int) -> bool:
        return ticket in self._waiting

    def get(self, ticket: int) -> Waiting | None:
        return self._waiting.get(ticket)

    def values(self) -> list[Waiting]:
        return list(self._waiting.values())

    def snapshot(self) -> tuple[QueuedReservation, ...]:
        """Waiting reservations, head first."""
        return tuple(QueuedReservation(w.holder, w.nbytes, w.deadline) for w in self.values())

    def add(
        self,
        holder: Holder,
        nbytes: int,
        now: float,
        timeout_s: float,
        requester: Address,
        node: str,
        then_lookup: Lookup | None,
    ) -> Waiting:
        """Queue a reservation at the tail of its node's queue, under a fresh ticket."""
        ticket = next(self._tickets)
        waiting = Waiting(
            ticket,
            holder,
            nbytes,
            now + timeout_s,
            timeout_s,
            requester,
            now + timeout_s / 2,
            node,
            then_lookup,
        )
        self._waiting[ticket] = waiting
        return waiting

    def pop(self, ticket: int) -> Waiting:
        return self._waiting.pop(ticket)

    def drop(self, doomed: Callable[[Waiting], bool]) -> int:
        """Remove every reservation ``doomed`` says; how many."""
        tickets = [w.ticket for w in self._waiting.values() if doomed(w)]
        for ticket in tickets:
            del self._waiting[ticket]
        return len(tickets)

    def waits_on(self, node: str) -> bool:
        return any(w.node == node for w in self._waiting.values())

    def count_on(self, node: str) -> int:
        return sum(1 for w in self._waiting.values() if w.node == node)

    def queued_bytes(self, node: str | None = None) -> int:
        """Bytes asked by the reservations waiting (on ``node``; None: on any)."""
        return sum(w.nbytes for w in self._waiting.values() if node in (None, w.node))

    def nodes(self) -> list[str]:
        """The nodes with a reservation waiting, in name order."""
        return sorted({w.node for w in self._waiting.values()})

    def due(self, now: float) -> list[Waiting]:
        """Reservations whose deadline has come, earliest first."""
        due = (w for w in self._waiting.values() if w.deadline <= now)
        return sorted(due, key=lambda w: (w.deadline, w.ticket))

    def pressed_nodes(self, now: float) -> set[str]:
        """The nodes with a reservation waiting past its half-way point."""
        return {w.node for w in self._waiting.values() if w.pressure_at <= now}

    def fitting_heads(self, free: Callable[[str], int]) -> Iterator[Waiting]:
        """Each node's heads, in order, while they fit ``free(node)``: each yielded one is
        removed (the caller grants it before asking for the next, so ``free`` sees it)."""
        blocked: set[str] = set()
        for head in list(self._waiting.values()):
            if head.node in blocked:
                continue
            if head.nbytes > free(head.node):
                blocked.add(head.node)
                continue
            del self._waiting[head.ticket]
            yield head
