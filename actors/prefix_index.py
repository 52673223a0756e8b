"""The prefix-cache manager's store of entry metadata: the entries, their index, LRU order, leases.

Entries are partitioned by (model, epoch, namespace), each partition indexed by a ``TokenTrie``.
An entry is *findable* (in its trie and the LRU order) until it is doomed or forgotten; a doomed
entry still exists (and is still charged) until its last lease goes. The manager decides what to
add, lease, doom or forget (``actors.prefix_cache``); this store keeps the structures consistent.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from actors.token_trie import PrefixMatch, TokenTrie
from runtime.messages import TokenIds

Partition = tuple[str, int, str]  # (model, epoch, namespace)


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
class Entry:
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
    def partition(self) -> Partition:
        return (self.key.model, self.key.epoch, self.namespace)


@dataclass(frozen=True, slots=True)
class _Lease:
    key: EntryKey
    sequence_id: int


class PrefixIndex:
    """Entries by key, one trie per partition, the LRU order of findable entries, and leases."""

    def __init__(self) -> None:
        self._entries: dict[EntryKey, Entry] = {}
        # Findable (not doomed) entries, least recently used first: the eviction order.
        self._lru: OrderedDict[EntryKey, None] = OrderedDict()
        self._tries: dict[Partition, TokenTrie] = {}
        self._leases: dict[int, _Lease] = {}
        self._next_lease_id = 1
        self._recency_clock = 0
        self._total_bytes = 0
        self._bytes_by_model: Counter[str] = Counter()  # what the router spreads new sessions by

    # ------------------------------------------------------------------ reading

    @property
    def total_bytes(self) -> int:
        """Sum of ``nbytes`` over every entry still charged (findable or doomed)."""
        return self._total_bytes

    def model_bytes(self, model: str) -> int:
        """Sum of ``nbytes`` over ``model``'s entries still charged (every epoch, namespace)."""
        return self._bytes_by_model[model]

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: EntryKey) -> bool:
        return key in self._entries

    def __getitem__(self, key: EntryKey) -> Entry:
        return self._entries[key]

    def get(self, key: EntryKey) -> Entry | None:
        return self._entries.get(key)

    def all(self) -> list[Entry]:
        """Every entry, doomed ones included (a copy: safe to forget entries while iterating)."""
        return list(self._entries.values())

    def least_recently_used(self) -> list[EntryKey]:
        """Findable entries, least recently used first (a copy)."""
        return list(self._lru)

    def snapshots(self) -> tuple[EntrySnapshot, ...]:
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

    def has_lease(self, lease_id: int) -> bool:
        return lease_id in self._leases

    def leased_keys(self) -> frozenset[EntryKey]:
        return frozenset(lease.key for lease in self._leases.values())

    def partitions(self) -> list[Partition]:
        """Every (model, epoch, namespace) with a trie."""
        return list(self._tries)

    def best_match(self, partition: Partition, prompt: TokenIds) -> PrefixMatch | None:
        trie = self._tries.get(partition)
        return trie.best_match(prompt) if trie is not None else None

    def find(self, partition: Partition, tokens: TokenIds, trimmable: bool) -> int | None:
        """The findable entry id with exactly these tokens and trimmability, if any."""
        trie = self._tries.get(partition)
        return trie.find(tokens, trimmable) if trie is not None else None

    def shorter_trimmable(self, partition: Partition, tokens: TokenIds) -> list[int]:
        """Findable trimmable entries whose tokens are a strict prefix of ``tokens``."""
        trie = self._tries.get(partition)
        return trie.strict_prefix_trimmable(tokens) if trie is not None else []

    # ------------------------------------------------------------------ changing

    def add(self, entry: Entry) -> None:
        """Index a new entry as the most recently used."""
        self._entries[entry.key] = entry
        self._total_bytes += entry.nbytes
        self._bytes_by_model[entry.key.model] += entry.nbytes
        self._recency_clock += 1
        trie = self._tries.setdefault(entry.partition, TokenTrie())
        trie.insert(
            entry.tokens, entry.trimmable, entry.key.entry_id, self._recency_clock, entry.points
        )
        self._lru[entry.key] = None

    def lease(self, entry: Entry, sequence_id: int) -> int:
        """A new lease on ``entry`` for ``sequence_id``; the entry is now the most recently used."""
        lease_id = self._next_lease_id
        self._next_lease_id += 1
        self._leases[lease_id] = _Lease(entry.key, sequence_id)
        entry.leases.add(lease_id)
        self._touch(entry)
        return lease_id

    def release_lease(self, lease_id: int) -> Entry:
        """Drop a lease (it must exist: ``has_lease``); returns the entry it was on."""
        lease = self._leases.pop(lease_id)
        entry = self._entries[lease.key]
        entry.leases.discard(lease_id)
        return entry

    def doom(self, entry: Entry) -> None:
        """Make a leased entry unfindable; it is dropped when its last lease is released."""
        self._unindex(entry)
        entry.doomed = True

    def forget(self, entry: Entry) -> None:
        """Remove every trace of an entry (its leases too); the caller tells the engine, or not."""
        if not entry.doomed:
            self._unindex(entry)
        del self._entries[entry.key]
        for lease_id in entry.leases:
            del self._leases[lease_id]
        self._total_bytes -= entry.nbytes
        self._bytes_by_model[entry.key.model] -= entry.nbytes
        if not self._bytes_by_model[entry.key.model]:
            del self._bytes_by_model[entry.key.model]

    def _touch(self, entry: Entry) -> None:
        self._recency_clock += 1
        trie = self._tries[entry.partition]
        trie.touch(entry.key.entry_id, entry.tokens, entry.trimmable, self._recency_clock)
        self._lru.move_to_end(entry.key)

    def _unindex(self, entry: Entry) -> None:
        trie = self._tries[entry.partition]
        trie.remove(entry.key.entry_id, entry.tokens, entry.trimmable)
        if not len(trie):
            del self._tries[entry.partition]
        del self._lru[entry.key]
