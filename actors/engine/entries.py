"""An engine's cached states (prefix entries) and its sessions' pinned instructions prefixes.

The prefix-cache manager indexes entries and decides reuse; the states stay here, in the engine that
made them, each holding a KV reservation of its own. Snapshots taken while a sequence prefills a
non-trimmable cache become *points* of its final entry: restorable at each point by cutting the
trimmable layers back and copying the others from the snapshot, so the full-attention KV is stored
once. A snapshot's bytes are the sequence's; one that finds no room is dropped. A session's pinned
prefix is a whole copy, its own entry.

See docs/design.md, "Prefix reuse and checkpoints" and "KV accounting".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from actors.engine.sequence import RestoreSource, Sequence
from runtime.backends.contract import Backend, SequenceState, Snapshot
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, Context
from runtime.kernel.stats import Counters
from runtime.messages import (
    Commit,
    Holder,
    HolderKind,
    Release,
    Reserve,
    TokenIds,
    Transfer,
    Unpin,
)

SessionKey = tuple[str, str]  # (namespace, session)


@dataclass
class _Entry:
    state: SequenceState
    nbytes: int
    namespace: str
    tokens: TokenIds
    pending: Commit | None = None  # a pinned copy waiting for its own reservation before commit
    points: dict[int, Snapshot] = field(default_factory=dict)  # restorable at these lengths too
    trimmable: bool = True
    keep_on_disk: bool = False  # a prewarm asked: written to the disk tier once committed


class Kept(NamedTuple):
    """An entry as the disk tier writes it: its key, its state and its points' snapshots."""

    namespace: str
    tokens: TokenIds
    trimmable: bool
    state: SequenceState
    points: dict[int, Snapshot]
    nbytes: int


__all__ = ["EntryStore", "Kept", "RestoreSource"]


class EntryStore:
    """Entries by id (ids never reused within an epoch) and pins by session."""

    def __init__(self, model: str, epoch: int, counters: Counters) -> None:
        self._model = model
        self._epoch = epoch
        self._counters = counters
        self._entries: dict[int, _Entry] = {}
        self._next_id = 1
        self._pins: dict[SessionKey, tuple[TokenIds, int]] = {}  # -> (tokens, entry id)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._entries

    def restore_source(self, entry_id: int | None, length: int) -> RestoreSource | None:
        """Entry ``entry_id``'s state, and its snapshot at ``length`` if it has one there."""
        entry = None if entry_id is None else self._entries.get(entry_id)
        if entry is None:
            return None
        return RestoreSource(entry.state, entry.points.get(length))

    def tokens(self, entry_id: int) -> TokenIds:
        """Entry ``entry_id``'s tokens (none if it is not held here)."""
        entry = self._entries.get(entry_id)
        return () if entry is None else entry.tokens

    def state(self, entry_id: int) -> SequenceState | None:
        """Entry ``entry_id``'s state, or None if it is not held here."""
        entry = self._entries.get(entry_id)
        return None if entry is None else entry.state

    def gauges(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "entry_bytes": sum(e.nbytes for e in self._entries.values()),
            "entry_points": sum(len(e.points) for e in self._entries.values()),
            "entry_point_bytes": sum(
                p.nbytes for e in self._entries.values() for p in e.points.values()
            ),
            "pins": len(self._pins),
        }

    def to_keep_on_disk(self, entry_id: int) -> Kept | None:
        """Entry ``entry_id`` was committed: what to write to disk now, if a prewarm asked."""
        entry = self._entries.get(entry_id)
        if entry is None or not entry.keep_on_disk:
            return None
        entry.keep_on_disk = False
        return _kept(entry)

    def kept(self) -> list[Kept]:
        """Every committed entry, most recently made last (what a clean shutdown writes)."""
        return [_kept(e) for e in self._entries.values() if e.pending is None]

    def clear(self) -> None:
        self._entries.clear()
        self._pins.clear()

    def holder(self, entry_id: int) -> Holder:
        return Holder(
            model=self._model, epoch=self._epoch, kind=HolderKind.PREFIX_ENTRY, id=entry_id
        )

    # ------------------------------------------------------------------ creating entries

    def detach(self, seq: Sequence, backend: Backend, ctx: Context) -> None:
        """Turn the sequence's cache into an entry keyed by exactly the tokens it holds.

        On a cache that cannot be trimmed, the sequence's snapshots become the entry's points.
        """
        state, seq.state = seq.state, None
        if state is None or state.length == 0 or not seq.reserved:
            return
        entry_id, commit = self._new(seq, state, backend)
        entry = self._entries[entry_id]
        entry.keep_on_disk = seq.request.keep_on_disk  # a prewarm's (a generate's stays False)
        if not commit.trimmable:  # a trimmable entry serves every prefix without snapshots
            for taken in seq.snapshots:
                if 0 < taken.length < state.length:
                    entry.points[taken.length] = taken
            entry.nbytes += sum(p.nbytes for p in entry.points.values())
            commit = msgspec.structs.replace(
                commit, nbytes=entry.nbytes, points=tuple(sorted(entry.points))
            )
        # The sequence's reservation already covers this state and its snapshots: move them.
        target = self.holder(entry_id)
        ctx.send(KV_KEEPER, Transfer(source=seq.holder, target=target, nbytes=entry.nbytes))
        ctx.send(PREFIX_CACHE, commit)
        self._counters.inc("entries_committed")

    def snapshot(self, seq: Sequence, snapshot: Snapshot) -> None:
        """A checkpoint of ``seq``'s untrimmable layers: kept if its reservation has room left."""
        self._counters.inc("snapshots_taken")
        if not seq.reserved or snapshot.nbytes > seq.snapshot_room:
            self._counters.inc("snapshots_refused")  # e.g. taken by a prewarm adopted meanwhile
            return
        seq.snapshot_room -= snapshot.nbytes
        seq.snapshots.append(snapshot)

    def pin_copy(self, seq: Sequence, state: SequenceState, backend: Backend, ctx: Context) -> None:
        """The session's instructions prefix: a whole copy, pinned once its bytes are granted."""
        entry_id, commit = self._new(seq, state, backend)
        key = (seq.namespace, seq.session)
        if key not in self._pins:
            commit = msgspec.structs.replace(commit, pinned=True)
            self._pins[key] = (commit.tokens, entry_id)
            self._counters.inc("pinned")
        self._entries[entry_id].pending = commit
        ctx.send(
            KV_KEEPER, Reserve(holder=self.holder(entry_id), nbytes=commit.nbytes, timeout_s=0.0)
        )
        self._counters.inc("snapshots_taken")

    def reserved(self, entry_id: int, ctx: Context) -> None:
        """A pinned copy's reservation was granted: commit it (or give the bytes back)."""
        entry = self._entries.get(entry_id)
        if entry is None or entry.pending is None:
            ctx.send(KV_KEEPER, Release(holder=self.holder(entry_id)))
            return
        ctx.send(PREFIX_CACHE, entry.pending)
        entry.pending = None
        self._counters.inc("entries_committed")

    def refused(self, entry_id: int) -> bool:
        """No room for this pinned copy: forget it. False if it was not ours."""
        if self._entries.pop(entry_id, None) is None:
            return False
        self._forget_pins((entry_id,))
        self._counters.inc("snapshots_refused")
        return True

    def take(self, entry_id: int, length: int, ctx: Context) -> RestoreSource | None:
        """Hand entry ``entry_id`` over to a sequence's restore (the prefix cache forgets it on
        ``ReleaseLease(take=True)``): it leaves this store, its bytes go back to the keeper (the
        sequence's own reservation covers the state from now on), and its state, with its
        snapshot at ``length``, is restored from in place. None if it is not held here."""
        entry = self._entries.pop(entry_id, None)
        if entry is None:
            return None
        self._forget_pins((entry_id,))
        ctx.send(KV_KEEPER, Release(holder=self.holder(entry_id)))
        self._counters.inc("entries_taken")
        return RestoreSource(entry.state, entry.points.get(length), taken=True)

    def drop(self, entry_ids: tuple[int, ...], ctx: Context) -> list[Kept]:
        """Free these entries (evicted, superseded, refused) and return their bytes; what they
        held, for the disk tier (their arrays live on only as long as it keeps them)."""
        self._forget_pins(entry_ids)
        dropped = []
        for entry_id in entry_ids:
            entry = self._entries.pop(entry_id, None)
            if entry is None:
                ctx.count_dead_letter("drop_unknown_entry")
                continue
            ctx.send(KV_KEEPER, Release(holder=self.holder(entry_id)))
            if entry.pending is None:
                dropped.append(_kept(entry))
        return dropped

    def _allocate_id(self) -> int:
        allocated = self._next_id
        self._next_id += 1
        return allocated

    def _new(self, seq: Sequence, state: SequenceState, backend: Backend) -> tuple[int, Commit]:
        entry_id = self._allocate_id()
        nbytes = backend.state_nbytes(state)
        tokens = seq.cache_tokens[: state.length]
        trimmable = backend.can_trim(state)
        self._entries[entry_id] = _Entry(state, nbytes, seq.namespace, tokens, trimmable=trimmable)
        commit = Commit(
            model=self._model,
            epoch=self._epoch,
            namespace=seq.namespace,
            entry_id=entry_id,
            tokens=tokens,
            nbytes=nbytes,
            trimmable=trimmable,
            generation=seq.generation,
        )
        return entry_id, commit

    # ------------------------------------------------------------------ session pins

    def plan_pin(self, seq: Sequence, ctx: Context) -> None:
        """Keep the session's instructions prefix pinned in the prefix cache while it lives.

        New instructions in the session unpin the old prefix; the first request with them
        snapshots and pins the new one (``seq.pin_at``).
        """
        assert seq.tokens is not None
        k = seq.instructions_tokens
        if not 0 < k < len(seq.tokens):
            return
        key = (seq.namespace, seq.session)
        pinned = self._pins.get(key)
        if pinned is not None and pinned[0] != seq.tokens[:k]:
            self.unpin(key, ctx)
            pinned = None
        if pinned is None:
            seq.pin_at = k

    def unpin(self, key: SessionKey, ctx: Context) -> bool:
        pinned = self._pins.pop(key, None)
        if pinned is None:
            return False
        ctx.send(PREFIX_CACHE, Unpin(model=self._model, epoch=self._epoch, entry_id=pinned[1]))
        self._counters.inc("unpinned")
        return True

    def _forget_pins(self, entry_ids: tuple[int, ...]) -> None:
        for key, (_, pinned_id) in list(self._pins.items()):
            if pinned_id in entry_ids:  # refused or evicted: the next request pins again
                del self._pins[key]


def _kept(entry: _Entry) -> Kept:
    points = {} if entry.trimmable else dict(entry.points)
    return Kept(entry.namespace, entry.tokens, entry.trimmable, entry.state, points, entry.nbytes)
