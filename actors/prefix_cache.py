"""The prefix-cache manager: which cached prompt states exist, who is using them, what to evict.

It holds metadata only. The KV arrays of an entry stay in the engine that made them (at
``engine_address(model, epoch)``), which allocates entry ids unique per (model, epoch); the manager
tells that engine to ``DropEntries`` when it evicts or resets an entry.

Entries are partitioned by (model, epoch, namespace), each partition indexed by a ``TokenTrie``:
one tenant's namespace never serves another's prompt, and state of one model load never serves
another load. A ``Lookup`` hit takes a lease; a leased entry is never evicted, superseded or
changed. ``ResetPrefixes`` bumps a per-(model, namespace) generation so state computed before a
reset can never be committed after it; leased entries in scope become *doomed*: no longer found,
dropped when their last lease is released.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from actors.token_trie import TokenTrie
from runtime.kernel.core import Address, Context, engine_address
from runtime.kernel.stats import Counters
from runtime.messages import (
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
    ReleaseLease,
    ResetPrefixes,
    ReusePath,
    Stats,
    TokenIds,
    Unpin,
)

# Present in every Stats reply, even while zero, so dashboards see a stable set of names.
_COUNTER_NAMES = (
    "lookups",
    "hits_exact",
    "hits_trim",
    "hits_checkpoint",
    "misses",
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


class EntryKey(NamedTuple):
    """Identifies an entry: engines allocate ids unique per (model, epoch) only."""

    model: str
    epoch: int
    entry_id: int


@dataclass(frozen=True, slots=True)
class EntrySnapshot:
    """Read-only view of one entry's metadata (for tests and diagnostics)."""

    entry_id: int
    model: str
    epoch: int
    namespace: str
    tokens: TokenIds
    nbytes: int
    trimmable: bool
    pinned: bool
    leases: int
    doomed: bool
    points: tuple[int, ...] = ()


@dataclass(slots=True)
class _Entry:
    key: EntryKey
    namespace: str
    tokens: TokenIds
    nbytes: int
    trimmable: bool
    pinned: bool
    points: tuple[int, ...] = ()  # shorter token counts it is also restorable at
    leases: set[int] = field(default_factory=set)
    doomed: bool = False

    @property
    def partition(self) -> _Partition:
        return (self.key.model, self.key.epoch, self.namespace)


@dataclass(frozen=True, slots=True)
class _Lease:
    key: EntryKey
    sequence_id: int


_Partition = tuple[str, int, str]  # (model, epoch, namespace)

_HIT_COUNTERS = {
    ReusePath.EXACT: "hits_exact",
    ReusePath.TRIM: "hits_trim",
    ReusePath.CHECKPOINT: "hits_checkpoint",
}


class PrefixCacheCore:
    """Synchronous core of the prefix-cache manager actor (inbox: ``PrefixInbox``)."""

    def __init__(self) -> None:
        self._entries: dict[EntryKey, _Entry] = {}
        # Findable (not doomed) entries, least recently used first: the eviction order.
        self._lru: OrderedDict[EntryKey, None] = OrderedDict()
        self._tries: dict[_Partition, TokenTrie] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease_id = 1
        self._recency_clock = 0
        self._model_resets: Counter[str] = Counter()
        self._namespace_resets: Counter[tuple[str, str]] = Counter()
        self._invalidated_epochs: set[tuple[str, int]] = set()
        self._total_bytes = 0
        self.counters = Counters(_COUNTER_NAMES)

    # ------------------------------------------------------------------ read-only accessors

    @property
    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over every entry still charged (findable or doomed)."""
        return self._total_bytes

    def entries(self) -> tuple[EntrySnapshot, ...]:
        """A snapshot of every entry's metadata, doomed ones included."""
        return tuple(
            EntrySnapshot(
                entry_id=e.key.entry_id,
                model=e.key.model,
                epoch=e.key.epoch,
                namespace=e.namespace,
                tokens=e.tokens,
                nbytes=e.nbytes,
                trimmable=e.trimmable,
                pinned=e.pinned,
                leases=len(e.leases),
                doomed=e.doomed,
                points=e.points,
            )
            for e in self._entries.values()
        )

    def leased_entry_ids(self) -> frozenset[EntryKey]:
        """Keys of the entries that hold at least one lease."""
        return frozenset(lease.key for lease in self._leases.values())

    def generation(self, model: str, namespace: str) -> int:
        """How many resets have covered (model, namespace); only ever grows."""
        return self._model_resets[model] + self._namespace_resets[(model, namespace)]

    # ------------------------------------------------------------------ actor protocol

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        """Apply one ``PrefixInbox`` message; anything else is counted as a dead letter."""
        match message:
            case Lookup():
                self._lookup(message, sender, ctx)
            case Commit():
                ctx.send(sender, self._commit(message))
            case ReleaseLease(lease_id=lease_id):
                self._release_lease(lease_id, ctx)
            case Unpin(model=model, epoch=epoch, entry_id=entry_id):
                entry = self._entries.get(EntryKey(model, epoch, entry_id))
                if entry is None:
                    ctx.count_dead_letter("unpin_unknown_entry")
                else:
                    entry.pinned = False
                    self.counters.inc("unpinned")
            case Evict(nbytes=nbytes, include_pinned=include_pinned):
                self._evict(nbytes, include_pinned, ctx)
            case InvalidateEpoch(model=model, epoch=epoch):
                self._invalidate_epoch(model, epoch)
            case ResetPrefixes(model=model, namespace=namespace):
                dropped = self._reset(model, namespace, ctx)
                ctx.send(sender, PrefixesReset(model=model, dropped=dropped))
            case GetStats():
                ctx.send(sender, self.statistics())
            case _:
                ctx.count_dead_letter("prefix_unexpected_message")

    def on_start(self, ctx: Context) -> None:
        """Nothing to set up: the index starts empty and fills from commits."""

    def on_stop(self, ctx: Context) -> None:
        """Nothing to release: the engines own the arrays and free them when they drain."""

    # ------------------------------------------------------------------ handlers

    def _lookup(self, request: Lookup, sender: Address, ctx: Context) -> None:
        self.counters.inc("lookups")
        trie = self._tries.get((request.model, request.epoch, request.namespace))
        match = trie.best_match(request.tokens) if trie is not None else None
        entry_id = lease_id = None
        if match is None:
            self.counters.inc("misses")
        else:
            entry = self._entries[EntryKey(request.model, request.epoch, match.entry_id)]
            entry_id, lease_id = match.entry_id, self._next_lease_id
            self._next_lease_id += 1
            self._leases[lease_id] = _Lease(entry.key, request.sequence_id)
            entry.leases.add(lease_id)
            self._touch(entry)
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
        )
        ctx.send(sender, result)

    def _commit(self, commit: Commit) -> Committed:
        key = EntryKey(commit.model, commit.epoch, commit.entry_id)
        partition = (commit.model, commit.epoch, commit.namespace)
        trie = self._tries.get(partition)
        refusal: str | None = None
        if (commit.model, commit.epoch) in self._invalidated_epochs:
            refusal = "refused_invalidated_epoch"
        elif commit.generation < self.generation(commit.model, commit.namespace):
            refusal = "refused_stale_generation"
        elif (
            not commit.tokens
            or commit.nbytes < 0
            or key in self._entries
            or (commit.points and commit.trimmable)
            or any(not 0 < p < len(commit.tokens) for p in commit.points)
        ):
            # Engine bugs: a reused entry id would corrupt both entries; a point outside the
            # tokens (or on a trimmable entry) would be restored from a snapshot that is not there.
            refusal = "refused_invalid"
        elif trie is not None and trie.find(commit.tokens, commit.trimmable) is not None:
            refusal = "refused_duplicate"
        if refusal is not None:
            self.counters.inc("commits_refused")
            self.counters.inc(refusal)
            return Committed(entry_id=commit.entry_id, accepted=False)

        if trie is None:
            trie = self._tries[partition] = TokenTrie()
        superseded: list[int] = []
        if commit.trimmable:
            # A longer trimmable entry serves every prompt a shorter one did, at least as well.
            for entry_id in trie.strict_prefix_trimmable(commit.tokens):
                shorter = self._entries[EntryKey(commit.model, commit.epoch, entry_id)]
                if not shorter.leases and not shorter.pinned:
                    self._forget(shorter)
                    superseded.append(entry_id)
            # _forget may have removed the partition's last entry, and with it the trie.
            trie = self._tries.setdefault(partition, trie)

        entry = _Entry(
            key=key,
            namespace=commit.namespace,
            tokens=commit.tokens,
            nbytes=commit.nbytes,
            trimmable=commit.trimmable,
            pinned=commit.pinned,
            points=tuple(sorted(set(commit.points))),
        )
        self._entries[key] = entry
        self._total_bytes += entry.nbytes
        self._recency_clock += 1
        trie.insert(entry.tokens, entry.trimmable, key.entry_id, self._recency_clock, entry.points)
        self._lru[key] = None
        self.counters.inc("commits")
        self.counters.inc("superseded", len(superseded))
        return Committed(entry_id=commit.entry_id, accepted=True, superseded=tuple(superseded))

    def _release_lease(self, lease_id: int, ctx: Context) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            # Unknown, already released, or its epoch was invalidated: nothing to undo.
            self.counters.inc("unknown_lease_releases")
            ctx.count_dead_letter("prefix_unknown_lease")
            return
        self.counters.inc("lease_releases")
        entry = self._entries[lease.key]
        entry.leases.discard(lease_id)
        if entry.doomed and not entry.leases:
            self._forget(entry)
            self._send_drops([entry.key], ctx)

    def _evict(self, nbytes: int, include_pinned: bool, ctx: Context) -> None:
        self.counters.inc("evict_requests")
        freed = 0
        evicted: list[EntryKey] = []
        for key in list(self._lru):
            if freed >= nbytes:
                break
            entry = self._entries[key]
            if entry.leases or (entry.pinned and not include_pinned):
                continue
            self._forget(entry)
            evicted.append(key)
            freed += entry.nbytes
        if freed < nbytes:
            self.counters.inc("evict_shortfalls")
        self.counters.inc("evictions", len(evicted))
        self.counters.inc("evicted_bytes", freed)
        self._send_drops(evicted, ctx)

    def _invalidate_epoch(self, model: str, epoch: int) -> None:
        # The draining engine frees its own arrays, so no DropEntries: just forget.
        self._invalidated_epochs.add((model, epoch))
        doomed_epoch = [e for e in self._entries.values() if e.key[:2] == (model, epoch)]
        for entry in doomed_epoch:
            self._forget(entry)
        self.counters.inc("invalidations")
        self.counters.inc("invalidated_entries", len(doomed_epoch))

    def _reset(self, model: str, namespace: str | None, ctx: Context) -> int:
        if namespace is None:
            self._model_resets[model] += 1
        else:
            self._namespace_resets[(model, namespace)] += 1
        no_longer_findable = 0
        dropped: list[EntryKey] = []
        for entry in list(self._entries.values()):
            in_scope = entry.key.model == model and namespace in (None, entry.namespace)
            if not in_scope or entry.doomed:
                continue
            no_longer_findable += 1
            if entry.leases:
                self._doom(entry)
            else:
                self._forget(entry)
                dropped.append(entry.key)
        self.counters.inc("resets")
        self.counters.inc("reset_entries", no_longer_findable)
        self._send_drops(dropped, ctx)
        return no_longer_findable

    def statistics(self) -> Stats:
        """Counters and gauges now (an immutable snapshot; also the reply to ``GetStats``)."""
        gauges = {
            "entries": len(self._entries),
            "bytes": self._total_bytes,
            "leases": len(self._leases),
            "doomed": sum(1 for e in self._entries.values() if e.doomed),
        }
        return Stats(actor="prefix", counters=self.counters.snapshot(), gauges=gauges)

    # ------------------------------------------------------------------ bookkeeping

    def _touch(self, entry: _Entry) -> None:
        self._recency_clock += 1
        trie = self._tries[entry.partition]
        trie.touch(entry.key.entry_id, entry.tokens, entry.trimmable, self._recency_clock)
        self._lru.move_to_end(entry.key)

    def _doom(self, entry: _Entry) -> None:
        """Make a leased entry unfindable; it is dropped when its last lease is released."""
        self._unindex(entry)
        entry.doomed = True

    def _forget(self, entry: _Entry) -> None:
        """Remove every trace of an entry (its leases too); the caller tells the engine, or not."""
        if not entry.doomed:
            self._unindex(entry)
        del self._entries[entry.key]
        for lease_id in entry.leases:
            del self._leases[lease_id]
        self._total_bytes -= entry.nbytes

    def _unindex(self, entry: _Entry) -> None:
        trie = self._tries[entry.partition]
        trie.remove(entry.key.entry_id, entry.tokens, entry.trimmable)
        if not len(trie):
            del self._tries[entry.partition]
        del self._lru[entry.key]

    @staticmethod
    def _send_drops(keys: list[EntryKey], ctx: Context) -> None:
        """One ``DropEntries`` per owning engine, ids in the order they were dropped."""
        by_engine: dict[tuple[str, int], list[int]] = {}
        for key in keys:
            by_engine.setdefault((key.model, key.epoch), []).append(key.entry_id)
        for (model, epoch), entry_ids in by_engine.items():
            ctx.send(
                engine_address(model, epoch), DropEntries(epoch=epoch, entry_ids=tuple(entry_ids))
            )
