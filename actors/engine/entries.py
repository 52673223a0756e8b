"""An engine's cached states (prefix entries) and its sessions' pinned instructions prefixes.

The prefix-cache manager indexes entries and decides reuse; the states themselves stay here, in
the engine that made them. Every entry holds a KV reservation of its own: a sequence's final state
takes over the sequence's bytes (``Transfer``).

Checkpoints of a cache that cannot be trimmed (sliding-window or recurrent layers) are snapshots of
only those layers (``Backend.snapshot``), taken while the sequence prefills. They become *points*
of the entry the sequence's final state turns into: that entry is restorable at each point, its
trimmable layers cut back and its untrimmable ones copied from the point's snapshot. So the
full-attention KV a hybrid model's checkpoints need is stored once, in the final state, instead
of once per checkpoint. A snapshot is extra memory: it asks for its own reservation, only if free
now (``Reserve(timeout_s=0)``), moved to the entry when the entry is made; one not granted by then
(or whose sequence leaves no entry) is given back. A session's pinned instructions prefix is a
whole copy instead, committed at once as its own entry, since it must outlive the conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from actors.engine.sequence import Sequence
from runtime.backends.contract import Backend, SequenceState, Snapshot
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, Context
from runtime.kernel.stats import Counters
from runtime.messages import Commit, Holder, HolderKind, Release, Reserve, TokenIds, Transfer, Unpin

SessionKey = tuple[str, str]  # (namespace, session)


@dataclass
class _Entry:
    state: SequenceState
    nbytes: int
    pending: Commit | None = None  # a pinned copy waiting for its own reservation before commit
    points: dict[int, Snapshot] = field(default_factory=dict)  # restorable at these lengths too


@dataclass
class _Snapshot:
    """A checkpoint snapshot of a live sequence, held until its final state becomes an entry."""

    snapshot: Snapshot
    granted: bool = False  # its reservation: asked for at once, granted only if free then


class RestoreSource(NamedTuple):
    """What a lookup hit restores from: an entry's state, and its snapshot at the hit's length."""

    state: SequenceState
    snapshot: Snapshot | None


class EntryStore:
    """Entries by id (ids never reused within an epoch) and pins by session."""

    def __init__(self, model: str, epoch: int, counters: Counters) -> None:
        self._model = model
        self._epoch = epoch
        self._counters = counters
        self._entries: dict[int, _Entry] = {}
        self._snapshots: dict[int, _Snapshot] = {}  # by id; ids shared with entries (holders)
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
            "pending_snapshots": len(self._snapshots),
            "pins": len(self._pins),
        }

    def clear(self) -> None:
        self._entries.clear()
        self._snapshots.clear()
        self._pins.clear()

    def holder(self, entry_id: int) -> Holder:
        return Holder(
            model=self._model, epoch=self._epoch, kind=HolderKind.PREFIX_ENTRY, id=entry_id
        )

    # ------------------------------------------------------------------ creating entries

    def detach(self, seq: Sequence, backend: Backend, ctx: Context) -> None:
        """Turn the sequence's cache into an entry keyed by exactly the tokens it holds.

        On a cache that cannot be trimmed, the sequence's granted snapshots become the entry's
        points; the caller gives back the others (``discard_snapshots``).
        """
        state, seq.state = seq.state, None
        if state is None or state.length == 0 or not seq.reserved:
            return
        entry_id, commit = self._new(seq, state, backend)
        entry, target = self._entries[entry_id], self.holder(entry_id)
        # The sequence's own reservation already covers this state: move it to the entry.
        ctx.send(KV_KEEPER, Transfer(source=seq.holder, target=target, nbytes=commit.nbytes))
        if not commit.trimmable:  # a trimmable entry serves every prefix without snapshots
            for snapshot_id in seq.snapshot_ids:
                taken = self._snapshots.get(snapshot_id)
                if taken is None or not taken.granted:
                    continue  # refused, or its grant is still on the way: given back later
                if not 0 < taken.snapshot.length < state.length:
                    continue
                del self._snapshots[snapshot_id]
                entry.points[taken.snapshot.length] = taken.snapshot
                entry.nbytes += taken.snapshot.nbytes
                source = self.holder(snapshot_id)
                ctx.send(
                    KV_KEEPER, Transfer(source=source, target=target, nbytes=taken.snapshot.nbytes)
                )
                ctx.send(KV_KEEPER, Release(holder=source))  # empty now: close its account
            commit = msgspec.structs.replace(
                commit, nbytes=entry.nbytes, points=tuple(sorted(entry.points))
            )
        ctx.send(PREFIX_CACHE, commit)
        self._counters.inc("entries_committed")

    def snapshot(self, seq: Sequence, snapshot: Snapshot, ctx: Context) -> None:
        """A checkpoint of ``seq``'s untrimmable layers: asks, only if free now, for its bytes."""
        snapshot_id = self._allocate_id()
        self._snapshots[snapshot_id] = _Snapshot(snapshot)
        seq.snapshot_ids.append(snapshot_id)
        holder = self.holder(snapshot_id)
        ctx.send(KV_KEEPER, Reserve(holder=holder, nbytes=snapshot.nbytes, timeout_s=0.0))
        self._counters.inc("snapshots_taken")

    def discard_snapshots(self, seq: Sequence, ctx: Context) -> None:
        """Give back the snapshots of an ended sequence that did not join an entry."""
        for snapshot_id in seq.snapshot_ids:
            taken = self._snapshots.pop(snapshot_id, None)
            if taken is not None and taken.granted:
                ctx.send(KV_KEEPER, Release(holder=self.holder(snapshot_id)))
            # Not granted yet: the late grant finds no snapshot and is given back (``reserved``).
        seq.snapshot_ids.clear()

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
        """A snapshot's reservation was granted: keep it (or give the bytes back)."""
        taken = self._snapshots.get(entry_id)
        if taken is not None:
            taken.granted = True
            return
        entry = self._entries.get(entry_id)
        if entry is None or entry.pending is None:
            ctx.send(KV_KEEPER, Release(holder=self.holder(entry_id)))
            return
        ctx.send(PREFIX_CACHE, entry.pending)
        entry.pending = None
        self._counters.inc("entries_committed")

    def refused(self, entry_id: int) -> bool:
        """No room for this snapshot: forget it. False if it was not ours."""
        ours = self._snapshots.pop(entry_id, None) or self._entries.pop(entry_id, None)
        if ours is None:
            return False
        self._forget_pins((entry_id,))
        self._counters.inc("snapshots_refused")
        return True

    def drop(self, entry_ids: tuple[int, ...], ctx: Context) -> None:
        """Free these entries (evicted, superseded, refused) and return their bytes."""
        self._forget_pins(entry_ids)
        for entry_id in entry_ids:
            if self._entries.pop(entry_id, None) is None:
                ctx.count_dead_letter("drop_unknown_entry")
                continue
            ctx.send(KV_KEEPER, Release(holder=self.holder(entry_id)))

    def _allocate_id(self) -> int:
        allocated = self._next_id
        self._next_id += 1
        return allocated

    def _new(self, seq: Sequence, state: SequenceState, backend: Backend) -> tuple[int, Commit]:
        entry_id = self._allocate_id()
        nbytes = backend.state_nbytes(state)
        self._entries[entry_id] = _Entry(state=state, nbytes=nbytes)
        commit = Commit(
            model=self._model,
            epoch=self._epoch,
            namespace=seq.namespace,
            entry_id=entry_id,
            tokens=seq.cache_tokens[: state.length],
            nbytes=nbytes,
            trimmable=backend.can_trim(state),
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
