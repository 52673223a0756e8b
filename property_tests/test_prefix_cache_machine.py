"""The prefix-cache manager's core checked against a brute-force model of the same rules.

The model keeps a plain list of entries and answers a lookup by scoring every entry (O(n·L)); the
core uses a token trie. A four-token vocabulary makes prefixes collide often, so trims, checkpoints,
supersedes and ties all come up. Byte accounting is checked from the messages alone: what an engine
would still hold is every accepted commit minus what ``DropEntries``, ``superseded`` lists and
epoch invalidation told it to free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from actors.prefix_cache import EntryKey, EntrySnapshot, PrefixCacheCore
from runtime.kernel.core import PREFIX_CACHE, ROUTER, Address, engine_address
from runtime.messages import (
    Commit,
    Committed,
    DropEntries,
    Evict,
    InvalidateEpoch,
    Lookup,
    LookupResult,
    Message,
    PrefixesReset,
    ReleaseLease,
    ResetPrefixes,
    ReusePath,
    TokenIds,
)
from runtime.testing.recording import RecordingContext

MODELS = ("m1", "m2")
NAMESPACES = ("a", "b")

models = st.sampled_from(MODELS)
namespaces = st.sampled_from(NAMESPACES)
token_lists = st.lists(st.integers(0, 3), max_size=6).map(tuple)
# Points of a checkpoint entry: kept only if strictly inside its tokens, unless the rule asks for
# invalid ones (which the core must refuse).
point_lists = st.lists(st.integers(0, 7), max_size=3).map(tuple)
# Relative to a model's current load: the torn-down previous load, the current one, or the next
# one already loading beside it (so two live epochs of one model coexist).
epoch_offsets = st.sampled_from((0, 0, 1, -1))
rarely = st.integers(0, 3).map(lambda n: n == 0)
# Lookup.take_within: mostly never take (-1), else mark a hit takeable (its engine may take it at
# the restore) where its entry loses at most this many tokens past the reuse point.
take_withins = st.sampled_from((-1, -1, 0, 2, 100))


@dataclass
class ModelEntry:
    key: EntryKey
    namespace: str
    tokens: TokenIds
    nbytes: int
    trimmable: bool
    pinned: bool
    last_used: int
    points: tuple[int, ...] = ()
    leases: set[int] = field(default_factory=set)
    doomed: bool = False


def common_prefix_len(a: TokenIds, b: TokenIds) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def usable(entry: ModelEntry, prompt: TokenIds) -> tuple[int, ReusePath] | None:
    """How many tokens of ``prompt`` the entry can serve, straight from the rules."""
    if entry.trimmable:
        matched = min(common_prefix_len(entry.tokens, prompt), len(prompt) - 1)
        path = ReusePath.EXACT if matched == len(entry.tokens) else ReusePath.TRIM
    else:  # restorable whole or at a point, when every token up to there prefixes the prompt
        depths = [
            d
            for d in (*entry.points, len(entry.tokens))
            if d <= len(prompt) - 1 and prompt[:d] == entry.tokens[:d]
        ]
        if not depths:
            return None
        matched, path = max(depths), ReusePath.CHECKPOINT
    return (matched, path) if matched >= 1 else None


def valid_points(tokens: TokenIds, trimmable: bool, points: tuple[int, ...]) -> bool:
    return not (trimmable and points) and all(0 < p < len(tokens) for p in points)


def normalized_drops(sent: list[tuple[Address, Message]]) -> dict[Address, set[int]]:
    """DropEntries by engine, asserting there is at most one per engine and it names its epoch."""
    drops: dict[Address, set[int]] = {}
    for to, message in sent:
        assert isinstance(message, DropEntries)
        assert to in {engine_address(model, message.epoch) for model in MODELS}
        assert to not in drops, "two DropEntries for one engine in one step"
        assert message.entry_ids, "empty DropEntries"
        drops[to] = set(message.entry_ids)
    return drops


class PrefixCacheMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.core = PrefixCacheCore()
        self.ctx = RecordingContext(PREFIX_CACHE)
        self.entries: dict[EntryKey, ModelEntry] = {}
        self.lease_owner: dict[int, EntryKey] = {}
        self.takeable: set[int] = set()  # leases whose lookup said takeable
        self.clock = 0
        self.model_resets: dict[str, int] = {}
        self.namespace_resets: dict[tuple[str, str], int] = {}
        self.invalidated: set[tuple[str, int]] = set()
        self.current_epoch = dict.fromkeys(MODELS, 1)
        self.next_entry_id: dict[tuple[str, int], int] = {}
        # What engines hold, as learned from messages only.
        self.charged: dict[EntryKey, int] = {}
        # Each leased entry as it was when first leased: it must not change while leased.
        self.leased_snapshot: dict[EntryKey, EntrySnapshot] = {}

    # ------------------------------------------------------------------ model helpers

    def generation(self, model: str, namespace: str) -> int:
        return self.model_resets.get(model, 0) + self.namespace_resets.get((model, namespace), 0)

    def drop(self, entry: ModelEntry) -> None:
        del self.entries[entry.key]
        for lease_id in entry.leases:
            del self.lease_owner[lease_id]

    def expect_drops(self, dropped: list[EntryKey]) -> dict[Address, set[int]]:
        expected: dict[Address, set[int]] = {}
        for key in dropped:
            expected.setdefault(engine_address(key.model, key.epoch), set()).add(key.entry_id)
        return expected

    def apply_drops(self, dropped: list[EntryKey]) -> None:
        """What the engines were told to drop (checked equal to ``expect_drops(dropped)``)."""
        for key in set(dropped):
            assert key not in self.lease_owner.values(), f"dropped leased entry {key}"
            del self.charged[key]

    def epoch(self, model: str, offset: int) -> int:
        return max(self.current_epoch[model] + offset, 1)

    def core_snapshot(self, key: EntryKey) -> EntrySnapshot:
        [snapshot] = [
            e for e in self.core.entries() if EntryKey(e.model, e.epoch, e.entry_id) == key
        ]
        return snapshot

    # ------------------------------------------------------------------ rules

    @initialize(
        seeds=st.lists(
            st.tuples(models, namespaces, token_lists, st.integers(1, 50), st.booleans()),
            max_size=16,
        )
    )
    def seed_entries(self, seeds: list[tuple[str, str, TokenIds, int, bool]]) -> None:
        """Start most runs with entries, since swarm testing often disables the commit rules."""
        for model, namespace, tokens, nbytes, trimmable in seeds:
            generation = self.generation(model, namespace)
            self.check_commit(model, 1, namespace, tokens, nbytes, trimmable, False, generation)

    @rule(
        model=models,
        epoch_offset=epoch_offsets,
        namespace=namespaces,
        tokens=token_lists,
        nbytes=st.integers(1, 50),
        trimmable=st.booleans(),
        pinned=rarely,
        stale=rarely,
        points=point_lists,
        invalid_points=rarely,
    )
    def commit(
        self,
        model: str,
        epoch_offset: int,
        namespace: str,
        tokens: TokenIds,
        nbytes: int,
        trimmable: bool,
        pinned: bool,
        stale: bool,
        points: tuple[int, ...],
        invalid_points: bool,
    ) -> None:
        epoch = self.epoch(model, epoch_offset)
        current = self.generation(model, namespace)
        generation = current - 1 if stale and current > 0 else current
        if not invalid_points:
            points = () if trimmable else tuple(p for p in points if 0 < p < len(tokens))
        self.check_commit(
            model, epoch, namespace, tokens, nbytes, trimmable, pinned, generation, points
        )

    @precondition(lambda self: self.entries)
    @rule(
        data=st.data(),
        keep=st.integers(0, 6),
        suffix=token_lists,
        nbytes=st.integers(1, 50),
        trimmable=st.booleans(),
        points=point_lists,
    )
    def commit_near_entry(
        self,
        data: st.DataObject,
        keep: int,
        suffix: TokenIds,
        nbytes: int,
        trimmable: bool,
        points: tuple[int, ...],
    ) -> None:
        """Commits that extend or branch off a cached entry: supersedes and trims happen here."""
        entry = self.entries[data.draw(st.sampled_from(sorted(self.entries)))]
        model, epoch, namespace = entry.key.model, entry.key.epoch, entry.namespace
        tokens = entry.tokens[:keep] + suffix
        generation = self.generation(model, namespace)
        points = () if trimmable else tuple(p for p in points if 0 < p < len(tokens))
        self.check_commit(
            model, epoch, namespace, tokens, nbytes, trimmable, False, generation, points
        )

    def check_commit(
        self,
        model: str,
        epoch: int,
        namespace: str,
        tokens: TokenIds,
        nbytes: int,
        trimmable: bool,
        pinned: bool,
        generation: int,
        points: tuple[int, ...] = (),
    ) -> None:
        current = self.generation(model, namespace)
        entry_id = self.next_entry_id.get((model, epoch), 0) + 1
        self.next_entry_id[(model, epoch)] = entry_id
        key = EntryKey(model, epoch, entry_id)
        engine = engine_address(model, epoch)

        live = [
            e
            for e in self.entries.values()
            if (e.key.model, e.key.epoch, e.namespace) == (model, epoch, namespace) and not e.doomed
        ]
        accepted = (
            (model, epoch) not in self.invalidated
            and generation >= current
            and bool(tokens)
            and valid_points(tokens, trimmable, points)
            and not any(e.tokens == tokens and e.trimmable == trimmable for e in live)
        )
        superseded: list[ModelEntry] = []
        if accepted and trimmable:
            superseded = sorted(
                (
                    e
                    for e in live
                    if e.trimmable
                    and not e.leases
                    and not e.pinned
                    and len(e.tokens) < len(tokens)
                    and tokens[: len(e.tokens)] == e.tokens
                ),
                key=lambda e: len(e.tokens),
            )

        self.core.handle(
            Commit(
                model=model,
                epoch=epoch,
                namespace=namespace,
                entry_id=entry_id,
                tokens=tokens,
                nbytes=nbytes,
                trimmable=trimmable,
                generation=generation,
                pinned=pinned,
                points=points,
            ),
            engine,
            self.ctx,
        )
        expected = Committed(
            entry_id=entry_id,
            accepted=accepted,
            superseded=tuple(e.key.entry_id for e in superseded),
        )
        assert self.ctx.take_sent() == [(engine, expected)]
        if accepted:
            for old in superseded:
                self.drop(old)
                del self.charged[old.key]
            self.clock += 1
            self.entries[key] = ModelEntry(
                key,
                namespace,
                tokens,
                nbytes,
                trimmable,
                pinned,
                last_used=self.clock,
                points=tuple(sorted(set(points))),
            )
            self.charged[key] = nbytes

    @rule(
        target=leases,
        model=models,
        epoch_offset=epoch_offsets,
        namespace=namespaces,
        prompt=token_lists,
        take_within=take_withins,
    )
    def lookup(
        self, model: str, epoch_offset: int, namespace: str, prompt: TokenIds, take_within: int
    ) -> object:
        epoch = self.epoch(model, epoch_offset)
        return self.check_lookup(model, epoch, namespace, prompt, take_within)

    @precondition(lambda self: self.entries)
    @rule(
        target=leases,
        data=st.data(),
        keep=st.integers(0, 6),
        suffix=token_lists,
        take_within=take_withins,
    )
    def lookup_near_entry(
        self, data: st.DataObject, keep: int, suffix: TokenIds, take_within: int
    ) -> object:
        """Prompts that share a prefix with a cached entry, where hits and ties happen."""
        entry = self.entries[data.draw(st.sampled_from(sorted(self.entries)))]
        prompt = entry.tokens[:keep] + suffix
        key = entry.key
        return self.check_lookup(key.model, key.epoch, entry.namespace, prompt, take_within)

    def check_lookup(
        self, model: str, epoch: int, namespace: str, prompt: TokenIds, take_within: int = -1
    ) -> object:
        scored = [
            (score, e)
            for e in self.entries.values()
            if (e.key.model, e.key.epoch, e.namespace) == (model, epoch, namespace)
            and not e.doomed
            and (score := usable(e, prompt)) is not None
        ]
        engine = engine_address(model, epoch)
        lookup = Lookup(
            model=model,
            epoch=epoch,
            namespace=namespace,
            tokens=prompt,
            sequence_id=1,
            take_within=take_within,
        )
        self.core.handle(lookup, engine, self.ctx)
        [(to, result)] = self.ctx.take_sent()
        assert to == engine
        assert isinstance(result, LookupResult)
        assert result.generation == self.generation(model, namespace)
        if not scored:
            assert (result.entry_id, result.matched, result.path) == (None, 0, ReusePath.MISS)
            assert result.lease_id is None
            assert not result.takeable
            return multiple()

        (matched, path), best = max(
            scored, key=lambda s: (s[0][0], s[0][1] is not ReusePath.TRIM, s[1].last_used)
        )
        assert (result.entry_id, result.matched, result.path) == (
            best.key.entry_id,
            matched,
            path,
        )
        # Leased like any hit; takeable where the engine may take it at its restore.
        assert result.takeable == (
            not best.pinned and 0 <= len(best.tokens) - matched <= take_within
        )
        assert result.lease_id is not None
        assert result.lease_id not in self.lease_owner
        snapshot = self.core_snapshot(best.key)
        assert (snapshot.model, snapshot.epoch, snapshot.namespace) == (model, epoch, namespace)
        assert snapshot.tokens[:matched] == prompt[:matched]
        if path is ReusePath.CHECKPOINT:  # whole, or at a point where it holds a snapshot
            assert matched == len(snapshot.tokens) or matched in snapshot.points

        self.clock += 1
        best.last_used = self.clock
        best.leases.add(result.lease_id)
        self.lease_owner[result.lease_id] = best.key
        self.leased_snapshot.setdefault(best.key, snapshot)
        if result.takeable:
            self.takeable.add(result.lease_id)
        return result.lease_id

    @rule(lease_id=consumes(leases))
    def take_lease(self, lease_id: int) -> None:
        """The engine took a takeable lease's entry at its restore: it leaves the index and the
        total at once, with no drop (the engine holds its state); its other leases are void."""
        if lease_id not in self.takeable or lease_id not in self.lease_owner:
            self.release_lease(lease_id)  # not takeable (or voided): released as it is
            return
        entry = self.entries[self.lease_owner[lease_id]]
        self.drop(entry)  # its leases with it: a later release of one is an unknown lease
        del self.charged[entry.key]
        self.core.handle(
            ReleaseLease(lease_id=lease_id, take=True), engine_address("m1", 1), self.ctx
        )
        assert self.ctx.take_sent() == []

    @rule(lease_id=consumes(leases))
    def release_lease(self, lease_id: int) -> None:
        key = self.lease_owner.pop(lease_id, None)
        dropped: list[EntryKey] = []
        if key is not None:
            entry = self.entries[key]
            entry.leases.discard(lease_id)
            if entry.doomed and not entry.leases:
                self.drop(entry)
                dropped.append(key)
        self.core.handle(ReleaseLease(lease_id=lease_id), engine_address("m1", 1), self.ctx)
        drops = normalized_drops(self.ctx.take_sent())
        assert drops == self.expect_drops(dropped)
        self.apply_drops(dropped)

    @rule(nbytes=st.integers(0, 40), include_pinned=rarely)
    def evict(self, nbytes: int, include_pinned: bool) -> None:
        freed = 0
        dropped: list[EntryKey] = []
        for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
            if freed >= nbytes:
                break
            if entry.leases or entry.doomed or (entry.pinned and not include_pinned):
                continue
            self.drop(entry)
            dropped.append(entry.key)
            freed += entry.nbytes
        self.core.handle(Evict(nbytes=nbytes, include_pinned=include_pinned), "kv", self.ctx)
        drops = normalized_drops(self.ctx.take_sent())
        assert drops == self.expect_drops(dropped)
        self.apply_drops(dropped)

    @rule(model=models, namespace=st.none() | namespaces)
    def reset(self, model: str, namespace: str | None) -> None:
        if namespace is None:
            self.model_resets[model] = self.model_resets.get(model, 0) + 1
        else:
            scope = (model, namespace)
            self.namespace_resets[scope] = self.namespace_resets.get(scope, 0) + 1
        in_scope = [
            e
            for e in self.entries.values()
            if e.key.model == model and namespace in (None, e.namespace) and not e.doomed
        ]
        dropped: list[EntryKey] = []
        for entry in in_scope:
            if entry.leases:
                entry.doomed = True
            else:
                self.drop(entry)
                dropped.append(entry.key)

        self.core.handle(ResetPrefixes(model=model, namespace=namespace), ROUTER, self.ctx)
        *drop_messages, (to, reply) = self.ctx.take_sent()
        assert (to, reply) == (ROUTER, PrefixesReset(model=model, dropped=len(in_scope)))
        drops = normalized_drops(drop_messages)
        assert drops == self.expect_drops(dropped)
        self.apply_drops(dropped)

    @rule(model=models)
    def reload_model(self, model: str) -> None:
        """Tear down the current load (its epoch is invalidated); the next one becomes current."""
        epoch = self.current_epoch[model]
        self.current_epoch[model] += 1
        self.invalidated.add((model, epoch))
        for entry in [e for e in self.entries.values() if e.key[:2] == (model, epoch)]:
            self.drop(entry)
        # The draining engine frees everything of that epoch by itself.
        self.charged = {k: n for k, n in self.charged.items() if k[:2] != (model, epoch)}
        self.core.handle(InvalidateEpoch(model=model, epoch=epoch), ROUTER, self.ctx)
        assert self.ctx.take_sent() == []

    # ------------------------------------------------------------------ invariants

    @invariant()
    def bytes_are_conserved(self) -> None:
        snapshot_bytes = sum(e.nbytes for e in self.core.entries())
        assert snapshot_bytes == self.core.total_bytes == sum(self.charged.values())

    @invariant()
    def entries_match_model(self) -> None:
        core_view = {
            EntryKey(e.model, e.epoch, e.entry_id): (
                e.namespace,
                e.tokens,
                e.points,
                e.leases,
                e.doomed,
            )
            for e in self.core.entries()
        }
        model_view = {
            k: (e.namespace, e.tokens, e.points, len(e.leases), e.doomed)
            for k, e in self.entries.items()
        }
        assert core_view == model_view
        assert self.core.leased_entry_ids() == set(self.lease_owner.values())

    @invariant()
    def leased_entries_never_change(self) -> None:
        self.leased_snapshot = {
            k: s for k, s in self.leased_snapshot.items() if k in self.lease_owner.values()
        }
        for key, before in self.leased_snapshot.items():
            after = self.core_snapshot(key)
            assert (after.namespace, after.tokens, after.nbytes, after.trimmable, after.pinned) == (
                before.namespace,
                before.tokens,
                before.nbytes,
                before.trimmable,
                before.pinned,
            )


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
