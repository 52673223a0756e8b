"""The prefix-cache manager: which cached prompt states exist, who is using them, what to evict.

It holds metadata only: an entry's KV arrays stay in the engine that made them, which it tells to
``DropEntries`` when it evicts or resets one, so no array travels between actors. Entries are
partitioned by (model, epoch, namespace), each indexed by a ``TokenTrie``, so one tenant's namespace
never serves another's prompt nor one load's state another's. A hit takes a lease, and a leased
entry is never evicted or changed; ``ResetPrefixes`` bumps a generation so state computed before a
reset is never committed after it. The bookkeeping is ``actors.prefix_index.PrefixIndex``.

The protocol and its invariants: docs/protocols.md, "Prefix cache".
"""

from __future__ import annotations

from collections import Counter
from typing import assert_never

from actors.prefix_index import Entry, EntryKey, EntrySnapshot, PrefixIndex
from actors.replicas import replica_base
from runtime.kernel.core import ROUTER, Address, Context, engine_address
from runtime.kernel.stats import Counters
from runtime.messages import (
    CachedElsewhere,
    Commit,
    Committed,
    DropEntries,
    Evict,
    GetStats,
    InvalidateEpoch,
    Lookup,
    LookupResult,
    Message,
    PrefixesReset,
    PrefixInbox,
    ReleaseLease,
    ResetPrefixes,
    ReusePath,
    Stats,
    Unpin,
)

__all__ = ["EntryKey", "EntrySnapshot", "PrefixCacheCore"]

# Present in every Stats reply, even while zero, so dashboards see a stable set of names.
_COUNTER_NAMES = (
    "lookups",
    "hits_exact",
    "hits_trim",
    "hits_checkpoint",
    "misses",
    "taken",
    "tokens_reused",
    "commits",
    "commits_refused",
    "refused_stale_generation",
    "refused_invalidated_epoch",
    "refused_invalid",
    "refused_duplicate",
    "superseded",
    "lease_releases",
    "unknown_lease_releases",
    "evict_requests",
    "evict_shortfalls",
    "evictions",
    "evicted_bytes",
    "resets",
    "reset_entries",
    "invalidations",
    "invalidated_entries",
    "unpinned",
)


_HIT_COUNTERS = {
    ReusePath.EXACT: "hits_exact",
    ReusePath.TRIM: "hits_trim",
    ReusePath.CHECKPOINT: "hits_checkpoint",
}


class PrefixCacheCore:
    """Synchronous core of the prefix-cache manager actor (inbox: ``PrefixInbox``)."""

    def __init__(self) -> None:
        self._index = PrefixIndex()
        self._model_resets: Counter[str] = Counter()
        self._namespace_resets: Counter[tuple[str, str]] = Counter()
        self._invalidated_epochs: set[tuple[str, int]] = set()
        self.counters = Counters(_COUNTER_NAMES)

    # ------------------------------------------------------------------ read-only accessors

    @property
    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over every entry still charged (findable or doomed)."""
        return self._index.total_bytes

    def entries(self) -> tuple[EntrySnapshot, ...]:
        """A snapshot of every entry's metadata, doomed ones included."""
        return self._index.snapshots()

    def leased_entry_ids(self) -> frozenset[EntryKey]:
        """Keys of the entries that hold at least one lease."""
        return self._index.leased_keys()

    def generation(self, model: str, namespace: str) -> int:
        """How many resets have covered (model, namespace); only ever grows."""
        return self._model_resets[model] + self._namespace_resets[(model, namespace)]

    # ------------------------------------------------------------------ actor protocol

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        """Apply one ``PrefixInbox`` message; anything else is counted as a dead letter."""
        if isinstance(message, PrefixInbox):
            self._receive(message, sender, ctx)
        else:
            ctx.count_dead_letter("prefix_unexpected_message")

    def _receive(self, message: PrefixInbox, sender: Address, ctx: Context) -> None:
        match message:
            case Lookup():
                self._lookup(message, sender, ctx)
            case Commit():
                ctx.send(sender, self._commit(message))
            case ReleaseLease(lease_id=lease_id) if not self._index.has_lease(lease_id):
                # Unknown, already released, or its epoch was invalidated: nothing to undo.
                self.counters.inc("unknown_lease_releases")
                ctx.count_dead_letter("prefix_unknown_lease")
            case ReleaseLease(lease_id=lease_id, take=take):
                self._release_lease(lease_id, take, ctx)
            case Unpin(model=model, epoch=epoch, entry_id=entry_id) if (
                EntryKey(model, epoch, entry_id) not in self._index
            ):
                ctx.count_dead_letter("unpin_unknown_entry")
            case Unpin(model=model, epoch=epoch, entry_id=entry_id):
                self._index[EntryKey(model, epoch, entry_id)].pinned = False
                self.counters.inc("unpinned")
            case Evict(nbytes=nbytes, include_pinned=include_pinned, epochs=epochs):
                self._evict(nbytes, include_pinned, epochs, ctx)
            case InvalidateEpoch(model=model, epoch=epoch):
                self._invalidate_epoch(model, epoch)
            case ResetPrefixes(model=model, namespace=namespace):
                dropped = self._reset(model, namespace, ctx)
                ctx.send(sender, PrefixesReset(model=model, dropped=dropped))
            case GetStats():
                ctx.send(sender, self.statistics())
            case _:
                assert_never(message)

    def on_start(self, ctx: Context) -> None:
        """Nothing to set up: the index starts empty and fills from commits."""

    def on_stop(self, ctx: Context) -> None:
        """Nothing to release: the engines own the arrays and free them when they drain."""

    # ------------------------------------------------------------------ handlers

    def _lookup(self, request: Lookup, sender: Address, ctx: Context) -> None:
        self.counters.inc("lookups")
        partition = (request.model, request.epoch, request.namespace)
        match = self._index.best_match(partition, request.tokens)
        entry_id = lease_id = None
        takeable = False
        if match is None:
            self.counters.inc("misses")
        else:
            entry = self._index[EntryKey(request.model, request.epoch, match.entry_id)]
            entry_id = match.entry_id
            # Leased like any hit: whether it is taken is the engine's call at the restore, where
            # it sees every sequence that holds or awaits one of its entries (a burst of lookups
            # decided here would hand it to the first and leave the rest cold).
            takeable = self._may_take(entry, match.matched, request.take_within)
            lease_id = self._index.lease(entry, request.sequence_id)
            self.counters.inc(_HIT_COUNTERS[match.path])
            self.counters.inc("tokens_reused", match.matched)
        result = LookupResult(
            sequence_id=request.sequence_id,
            epoch=request.epoch,
            entry_id=entry_id,
            matched=0 if match is None else match.matched,
            path=ReusePath.MISS if match is None else match.path,
            lease_id=lease_id,
            generation=self.generation(request.model, request.namespace),
            takeable=takeable,
        )
        ctx.send(request.reply_to or sender, result)  # reply_to: a lookup the keeper sent on
        if replica_base(request.model) is not None:
            self._elsewhere(request, result.matched, ctx)

    @staticmethod
    def _may_take(entry: Entry, matched: int, take_within: int) -> bool:
        """Whether the engine may take a hit's entry at its restore instead of copying it: it is
        not a session's pinned prefix, and at most ``take_within`` of its tokens lie past the
        reuse point (what is lost with it)."""
        lost = len(entry.tokens) - matched
        return 0 <= lost <= take_within and not entry.pinned

    def _elsewhere(self, request: Lookup, matched_here: int, ctx: Context) -> None:
        """Tell the router what every replica of the model holds of this prompt (and how much
        cached state each holds): its routing estimates each replica's time to first token."""
        base = replica_base(request.model)
        matches: dict[str, int] = {}
        resident: dict[str, int] = {request.model: self._index.model_bytes(request.model)}
        for model, epoch, namespace in self._index.partitions():
            if (
                model == request.model
                or replica_base(model) != base
                or (model, epoch) in self._invalidated_epochs
            ):
                continue
            resident[model] = self._index.model_bytes(model)
            if namespace != request.namespace:
                continue
            match = self._index.best_match((model, epoch, namespace), request.tokens)
            if match is not None and match.matched > matches.get(model, 0):
                matches[model] = match.matched
        best = max(matches.items(), key=lambda item: item[1], default=("", 0))
        if best[1] > matched_here:
            self.counters.inc("cached_elsewhere")
        hint = CachedElsewhere(
            sequence_id=request.sequence_id,
            epoch=request.epoch,
            model=request.model,
            elsewhere=best[0],
            matched_here=matched_here,
            matched_there=best[1],
            tokens=request.tokens,
            facts=request.facts,
            matches=matches,
            resident=resident,
        )
        ctx.send(ROUTER, hint)

    def _commit(self, commit: Commit) -> Committed:
        key = EntryKey(commit.model, commit.epoch, commit.entry_id)
        partition = (commit.model, commit.epoch, commit.namespace)
        refusal: str | None = None
        if (commit.model, commit.epoch) in self._invalidated_epochs:
            refusal = "refused_invalidated_epoch"
        elif commit.generation < self.generation(commit.model, commit.namespace):
            refusal = "refused_stale_generation"
        elif (
            not commit.tokens
            or commit.nbytes < 0
            or key in self._index
            or (commit.points and commit.trimmable)
            or any(not 0 < p < len(commit.tokens) for p in commit.points)
        ):
            # Engine bugs: a reused entry id would corrupt both entries; a point outside the
            # tokens (or on a trimmable entry) would be restored from a snapshot that is not there.
            refusal = "refused_invalid"
        elif self._index.find(partition, commit.tokens, commit.trimmable) is not None:
            refusal = "refused_duplicate"
        if refusal is not None:
            self.counters.inc("commits_refused")
            self.counters.inc(refusal)
            return Committed(entry_id=commit.entry_id, accepted=False)

        superseded: list[int] = []
        if commit.trimmable:
            # A longer trimmable entry serves every prompt a shorter one did, at least as well.
            for entry_id in self._index.shorter_trimmable(partition, commit.tokens):
                shorter = self._index[EntryKey(commit.model, commit.epoch, entry_id)]
                if not shorter.leases and not shorter.pinned:
                    self._index.forget(shorter)
                    superseded.append(entry_id)

        entry = Entry(
            key=key,
            namespace=commit.namespace,
            tokens=commit.tokens,
            nbytes=commit.nbytes,
            trimmable=commit.trimmable,
            pinned=commit.pinned,
            points=tuple(sorted(set(commit.points))),
        )
        self._index.add(entry)
        self.counters.inc("commits")
        self.counters.inc("superseded", len(superseded))
        return Committed(entry_id=commit.entry_id, accepted=True, superseded=tuple(superseded))

    def _release_lease(self, lease_id: int, take: bool, ctx: Context) -> None:
        self.counters.inc("lease_releases")
        entry = self._index.release_lease(lease_id)
        if take:
            # The engine took it at its restore: its state is a sequence's now. Forgotten, leases
            # and all (the engine took it only with no other of its sequences holding or awaiting
            # it), and no DropEntries: the engine already let it go.
            self._index.forget(entry)
            self.counters.inc("taken")
        elif entry.doomed and not entry.leases:
            self._index.forget(entry)
            self._send_drops([entry.key], ctx)

    def _evict(
        self,
        nbytes: int,
        include_pinned: bool,
        epochs: tuple[tuple[str, int], ...] | None,
        ctx: Context,
    ) -> None:
        self.counters.inc("evict_requests")
        freed = 0
        evicted: list[EntryKey] = []
        on_node = None if epochs is None else set(epochs)  # the short node's entries only
        for key in self._index.least_recently_used():
            if freed >= nbytes:
                break
            entry = self._index[key]
            if entry.leases or (entry.pinned and not include_pinned):
                continue
            if on_node is not None and (key.model, key.epoch) not in on_node:
                continue
            self._index.forget(entry)
            evicted.append(key)
            freed += entry.nbytes
        if freed < nbytes:
            self.counters.inc("evict_shortfalls")
        self.counters.inc("evictions", len(evicted))
        self.counters.inc("evicted_bytes", freed)
        self._send_drops(evicted, ctx, spill=True)

    def _invalidate_epoch(self, model: str, epoch: int) -> None:
        # The draining engine frees its own arrays, so no DropEntries: just forget.
        self._invalidated_epochs.add((model, epoch))
        doomed_epoch = [e for e in self._index.all() if e.key[:2] == (model, epoch)]
        for entry in doomed_epoch:
            self._index.forget(entry)
        self.counters.inc("invalidations")
        self.counters.inc("invalidated_entries", len(doomed_epoch))

    def _reset(self, model: str, namespace: str | None, ctx: Context) -> int:
        if namespace is None:
            self._model_resets[model] += 1
        else:
            self._namespace_resets[(model, namespace)] += 1
        no_longer_findable = 0
        dropped: list[EntryKey] = []
        for entry in self._index.all():
            in_scope = entry.key.model == model and namespace in (None, entry.namespace)
            if not in_scope or entry.doomed:
                continue
            no_longer_findable += 1
            if entry.leases:
                self._index.doom(entry)
            else:
                self._index.forget(entry)
                dropped.append(entry.key)
        self.counters.inc("resets")
        self.counters.inc("reset_entries", no_longer_findable)
        self._send_drops(dropped, ctx)
        return no_longer_findable

    def statistics(self) -> Stats:
        """Counters and gauges now (an immutable snapshot; also the reply to ``GetStats``)."""
        gauges = {
            "entries": len(self._index),
            "bytes": self._index.total_bytes,
            "leases": self._index.lease_count,
            "doomed": sum(1 for e in self._index.all() if e.doomed),
        }
        return Stats(actor="prefix", counters=self.counters.snapshot(), gauges=gauges)

    # ------------------------------------------------------------------ bookkeeping

    @staticmethod
    def _send_drops(keys: list[EntryKey], ctx: Context, spill: bool = False) -> None:
        """One ``DropEntries`` per owning engine, ids in the order they were dropped."""
        by_engine: dict[tuple[str, int], list[int]] = {}
        for key in keys:
            by_engine.setdefault((key.model, key.epoch), []).append(key.entry_id)
        for (model, epoch), entry_ids in by_engine.items():
            ctx.send(
                engine_address(model, epoch),
                DropEntries(epoch=epoch, entry_ids=tuple(entry_ids), spill=spill),
            )
