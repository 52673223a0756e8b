"""The prefix-cache manager's protocol: lookups and their leases, commits, pins, eviction, and
dropping a model epoch's entries (the manager tells the owning engine which to free).
"""

from __future__ import annotations

from runtime.messages.vocabulary import Message, PromptFacts, ReusePath, TokenIds


class Lookup(Message, frozen=True):
    """Find the longest usable cached prefix of ``tokens``; answered ``LookupResult``.

    ``sequence_id`` names the sequence that will hold the lease on a hit. ``reply_to``: who hears
    the answer (None: the sender); the keeper sets it to the engine when it sends the lookup an
    engine's ``Reserve`` carried (``Reserve.then_lookup``). ``facts``: a replica's chat prompt's
    rendering, passed on in ``CachedElsewhere`` should the request move. ``take_within``: the
    most tokens of the hit's entry past the reuse point the engine would give up to *take* the
    entry (it leaves the cache and the sequence cuts its state back in place, no copy) where
    nobody else holds it; -1: never take (docs/protocols.md, "Prefix cache").
    """

    model: str
    epoch: int
    namespace: str
    tokens: TokenIds
    sequence_id: int
    reply_to: str | None = None
    facts: PromptFacts | None = None
    take_within: int = -1


class LookupResult(Message, frozen=True):
    """``entry_id`` None on a miss. ``matched`` tokens of the entry are usable (after trimming).

    ``generation`` counts resets of this (model, namespace); a later ``Commit`` carries it back so
    state computed before a reset can never be committed after it. ``takeable``: the hit is
    leased as any other, and the engine may take it at the restore (``Lookup.take_within``: at
    most that many of its tokens lie past the reuse point, and it is not pinned) if then no other
    sequence of its own holds or awaits it; it says so with ``ReleaseLease(take=True)``.
    """

    sequence_id: int
    epoch: int
    entry_id: int | None
    matched: int
    path: ReusePath
    lease_id: int | None
    generation: int
    takeable: bool = False


class CachedElsewhere(Message, frozen=True):
    """Prefix manager → router, after every ``Lookup`` of a replica ``model`` (actors/replicas.py):
    it matched ``matched_here`` tokens there; ``matches`` holds what each other replica of the
    same model holds of the same prompt (those holding any), ``elsewhere`` the one holding most
    (``matched_there``; ``""`` and 0 when none holds any), ``resident`` the cached bytes each
    replica holds. The router learns the request's uncached tokens from it (its replica's queue)
    and may move the request, if it has not started, to the replica whose estimated time to first
    token is lowest (docs/protocols.md, "Replicas and routing"); it sends the prompt's ``tokens``
    and ``facts`` (the lookup's) with it, not to tokenize twice."""

    sequence_id: int
    epoch: int
    model: str
    elsewhere: str
    matched_here: int
    matched_there: int
    tokens: TokenIds = ()
    facts: PromptFacts | None = None
    matches: dict[str, int] = {}  # noqa: RUF012 (a msgspec default; ruff cannot see the base)
    resident: dict[str, int] = {}  # noqa: RUF012 (a msgspec default; ruff cannot see the base)


class Commit(Message, frozen=True):
    """Register engine-owned state ``entry_id`` whose cache holds exactly ``tokens``.

    ``trimmable`` entries serve any shared prefix; others only when all their tokens prefix a
    prompt, or at one of their ``points``: shorter token counts at which the entry also holds a
    checkpoint of its untrimmable layers (its trimmable layers are cut back to the point).
    ``pinned`` entries are evicted only under a waiting reservation's pressure.
    """

    model: str
    epoch: int
    namespace: str
    entry_id: int
    tokens: TokenIds
    nbytes: int
    trimmable: bool
    generation: int
    pinned: bool = False
    points: tuple[int, ...] = ()


class Committed(Message, frozen=True):
    """Reply to ``Commit``: ``superseded`` lists entries dropped because this one covers them."""

    entry_id: int
    accepted: bool
    superseded: tuple[int, ...] = ()


class ReleaseLease(Message, frozen=True):
    """Engine → prefix manager: the lease's sequence no longer needs its entry kept. ``take``: it
    took the (takeable) entry at its restore: the manager forgets the entry at once, without a
    ``DropEntries`` (the engine holds its state now; any other lease on it is void)."""

    lease_id: int
    take: bool = False


class Unpin(Message, frozen=True):
    """Engine → prefix manager: entry ``entry_id`` is no longer its session's instructions prefix
    (the instructions changed, or the session ended); it becomes an ordinary LRU entry."""

    model: str
    epoch: int
    entry_id: int


class Evict(Message, frozen=True):
    """Keeper → prefix manager: free at least ``nbytes`` from unleased entries, LRU first.

    ``epochs``: only entries of these (model, epoch) pairs, the ones holding bytes on the node
    whose budget is short (None: any entry; the keeper sends None while every engine is on the
    host).
    """

    nbytes: int
    include_pinned: bool = False
    epochs: tuple[tuple[str, int], ...] | None = None


class InvalidateEpoch(Message, frozen=True):
    """Forget every entry of ``model`` at ``epoch`` (the engine frees the arrays itself)."""

    model: str
    epoch: int


class DropEntries(Message, frozen=True):
    """Prefix manager → engine: free the state of these entries and release their reservations."""

    epoch: int
    entry_ids: tuple[int, ...]
    # Evicted for room (not reset or superseded): worth keeping in the disk tier, if it has one.
    spill: bool = False
