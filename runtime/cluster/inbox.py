"""The host's mail to one engine process, grouped into Ray calls (outbox.py: the other way).

Each message goes on at once, in a call of its own, except after a grant whose lookup's answer
is on its way: when a sequence's ``Reserve`` carries its ``Lookup`` (``then_lookup``), the keeper
sends ``Reserved`` to the engine and, in the same handler, the lookup to the prefix manager,
which answers every lookup, to the engine. So such a ``Reserved`` waits here, with any mail after
it, until that sequence's ``LookupResult`` arrives, and all of it crosses in one call: a crossing
fewer per request. The engine gets the same messages in the same order; only their grouping
changes. What waits goes at the proxy's next poll at the latest (docs/protocols.md, "Ray").
"""

from __future__ import annotations

from runtime.cluster.outbox import Wired
from runtime.kernel.core import Address
from runtime.kernel.stats import Counters
from runtime.messages import (
    Holder,
    HolderKind,
    Lookup,
    LookupResult,
    Message,
    Release,
    ReservationRefused,
    Reserve,
    Reserved,
    encode,
)


class Inbox:
    """Mail from the host's actors to one engine process (see module docstring).

    ``grant_with_lookup`` False sends every message in a call of its own (to measure the merge).
    """

    def __init__(self, counters: Counters, grant_with_lookup: bool = True) -> None:
        self._counters = counters
        self._merge = grant_with_lookup
        self._lookup_follows: set[Holder] = set()  # sequences whose Reserve carried their Lookup
        self._awaited: set[tuple[int, int]] = set()  # (epoch, sequence) answers the mail waits for
        self._held: list[Wired] = []

    def __len__(self) -> int:
        return len(self._held)

    def sent_by_engine(self, message: Message) -> None:
        """Note what the engine asked of the keeper: whose grant a lookup's answer will follow."""
        match message:
            case Reserve(holder=holder, then_lookup=Lookup()) if (
                self._merge and holder.kind is HolderKind.SEQUENCE
            ):
                self._lookup_follows.add(holder)
            case Release(holder=holder, nbytes=None):  # given up: it may never be granted
                self._lookup_follows.discard(holder)

    def put(self, sender: Address, message: Message) -> list[Wired]:
        """``message`` from ``sender`` to the engine: the mail to send now, in one call (empty:
        it waits for a lookup's answer)."""
        match message:
            case Reserved(holder=holder) if holder in self._lookup_follows:
                self._lookup_follows.discard(holder)
                self._awaited.add((holder.epoch, holder.id))
                self._counters.inc("transport_grants_held")
            case ReservationRefused(holder=holder):
                self._lookup_follows.discard(holder)
            case LookupResult(epoch=epoch, sequence_id=sequence_id):
                self._awaited.discard((epoch, sequence_id))
        self._held.append((sender, encode(message)))
        return [] if self._awaited else self.take()

    def take(self) -> list[Wired]:
        """Everything waiting, oldest first, for one call (answers still awaited are no longer)."""
        items, self._held = self._held, []
        if self._awaited:
            self._awaited.clear()
            self._counters.inc("transport_grants_sent_unanswered")
        return items
