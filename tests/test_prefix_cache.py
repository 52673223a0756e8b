"""Examples of the prefix-cache manager's protocol, driven through its synchronous core."""

from __future__ import annotations

import pytest

from actors.prefix_cache import EntryKey, PrefixCacheCore
from runtime.kernel.core import PREFIX_CACHE, ROUTER, engine_address
from runtime.messages import (
    Commit,
    Committed,
    DropEntries,
    Evict,
    GetStats,
    InvalidateEpoch,
    Lookup,
    LookupResult,
    PrefixesReset,
    ReleaseLease,
    ResetPrefixes,
    ReusePath,
    Stats,
    TokenIds,
)
from runtime.testing.recording import RecordingContext

MODEL = "m"
ENGINE = engine_address(MODEL, 1)


@pytest.fixture
def core() -> PrefixCacheCore:
    return PrefixCacheCore()


@pytest.fixture
def ctx() -> RecordingContext:
    return RecordingContext(PREFIX_CACHE)


def commit(
    core: PrefixCacheCore,
    ctx: RecordingContext,
    entry_id: int,
    tokens: TokenIds,
    *,
    nbytes: int = 10,
    trimmable: bool = True,
    pinned: bool = False,
    namespace: str = "a",
    epoch: int = 1,
    model: str = MODEL,
    generation: int | None = None,
    points: tuple[int, ...] = (),
) -> Committed:
    if generation is None:
        generation = core.generation(model, namespace)
    message = Commit(
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
    )
    engine = engine_address(model, epoch)
    core.handle(message, engine, ctx)
    [(to, reply)] = ctx.take_sent()
    assert to == engine
    assert isinstance(reply, Committed)
    return reply


def lookup(
    core: PrefixCacheCore,
    ctx: RecordingContext,
    tokens: TokenIds,
    *,
    namespace: str = "a",
    epoch: int = 1,
    model: str = MODEL,
    sequence_id: int = 7,
    take_within: int = -1,
) -> LookupResult:
    message = Lookup(
        model=model,
        epoch=epoch,
        namespace=namespace,
        tokens=tokens,
        sequence_id=sequence_id,
        take_within=take_within,
    )
    engine = engine_address(model, epoch)
    core.handle(message, engine, ctx)
    [(to, reply)] = ctx.take_sent()
    assert to == engine
    assert isinstance(reply, LookupResult)
    assert reply.sequence_id == sequence_id
    assert reply.epoch == epoch
    return reply


def hit(result: LookupResult) -> tuple[int | None, int, ReusePath]:
    return result.entry_id, result.matched, result.path


def stats(core: PrefixCacheCore, ctx: RecordingContext) -> Stats:
    core.handle(GetStats(), ROUTER, ctx)
    [(_, reply)] = ctx.take_sent()
    assert isinstance(reply, Stats)
    return reply


# --------------------------------------------------------------------------- lookup paths


def test_exact_hit_reuses_whole_entry_and_takes_lease(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3))
    result = lookup(core, ctx, (1, 2, 3, 4), sequence_id=42)
    assert hit(result) == (1, 3, ReusePath.EXACT)
    assert result.lease_id is not None
    assert core.leased_entry_ids() == {EntryKey(MODEL, 1, 1)}


def test_whole_prompt_match_leaves_one_token_to_compute(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3))
    assert hit(lookup(core, ctx, (1, 2, 3))) == (1, 2, ReusePath.TRIM)


def test_trimmable_entry_is_cut_to_common_prefix(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3, 4))
    assert hit(lookup(core, ctx, (1, 2, 9, 9))) == (1, 2, ReusePath.TRIM)
    assert hit(lookup(core, ctx, (1, 2))) == (1, 1, ReusePath.TRIM)


def test_checkpoint_serves_only_whole_with_a_token_left(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3), trimmable=False)
    assert hit(lookup(core, ctx, (1, 2, 3, 4))) == (1, 3, ReusePath.CHECKPOINT)
    assert hit(lookup(core, ctx, (1, 2, 3))) == (None, 0, ReusePath.MISS)
    assert hit(lookup(core, ctx, (1, 2, 4, 5))) == (None, 0, ReusePath.MISS)


def test_a_checkpoint_entry_also_serves_at_its_points(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    results: list[LookupResult] = []

    def served(prompt: TokenIds) -> tuple[int | None, int, ReusePath]:
        results.append(lookup(core, ctx, prompt))
        return hit(results[-1])

    commit(core, ctx, 1, (1, 2, 3, 4, 5), trimmable=False, points=(2, 4))
    assert served((1, 2, 3, 4, 5, 6)) == (1, 5, ReusePath.CHECKPOINT)
    assert served((1, 2, 3, 4, 9)) == (1, 4, ReusePath.CHECKPOINT)
    assert served((1, 2, 3, 9)) == (1, 2, ReusePath.CHECKPOINT)  # not at 3: no snapshot there
    assert served((1, 9)) == (None, 0, ReusePath.MISS)
    # Another conversation with a point at the same place: the most recently used serves.
    commit(core, ctx, 2, (1, 2, 7, 7), trimmable=False, points=(2,))
    assert served((1, 2, 9))[0] == 2
    served((1, 2, 3, 4, 9))  # uses entry 1
    assert served((1, 2, 9))[0] == 1
    # Evicting one leaves the other's point in place.
    for result in results:
        if result.lease_id is not None:
            core.handle(ReleaseLease(lease_id=result.lease_id), ENGINE, ctx)
    ctx.take_sent()
    core.handle(Evict(nbytes=1), "kv", ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(2,), spill=True))]
    assert hit(lookup(core, ctx, (1, 2, 9))) == (1, 2, ReusePath.CHECKPOINT)


@pytest.mark.parametrize(
    ("trimmable", "points"),
    [(True, (1,)), (False, (0,)), (False, (3,)), (False, (5,))],
    ids=["trimmable-with-points", "point-zero", "point-at-the-end", "point-past-the-end"],
)
def test_points_outside_the_tokens_or_on_a_trimmable_entry_are_refused(
    core: PrefixCacheCore, ctx: RecordingContext, trimmable: bool, points: tuple[int, ...]
) -> None:
    reply = commit(core, ctx, 1, (1, 2, 3), trimmable=trimmable, points=points)
    assert not reply.accepted
    assert core.statistics().counters["refused_invalid"] == 1


def test_miss_has_no_lease(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    result = lookup(core, ctx, (1, 2, 3))
    assert hit(result) == (None, 0, ReusePath.MISS)
    assert result.lease_id is None
    commit(core, ctx, 1, (1,))
    # A one-token prompt can reuse nothing: that token must run through the model.
    assert hit(lookup(core, ctx, (1,))) == (None, 0, ReusePath.MISS)
    assert core.leased_entry_ids() == frozenset()


def test_longest_usable_prefix_wins(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2, 3), trimmable=False)
    commit(core, ctx, 2, (1, 2, 5, 6))
    assert hit(lookup(core, ctx, (1, 2, 3, 4))) == (1, 3, ReusePath.CHECKPOINT)
    assert hit(lookup(core, ctx, (1, 2, 5, 6, 7))) == (2, 4, ReusePath.EXACT)


def test_tie_prefers_whole_entry_over_more_recent_trim(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2), pinned=True)  # pinned, so entry 2 does not supersede it
    commit(core, ctx, 2, (1, 2, 7))
    commit(core, ctx, 3, (5, 6), trimmable=False)
    commit(core, ctx, 4, (5, 6, 7))
    assert hit(lookup(core, ctx, (1, 2, 5))) == (1, 2, ReusePath.EXACT)
    assert hit(lookup(core, ctx, (5, 6, 5))) == (3, 2, ReusePath.CHECKPOINT)


def test_tie_between_trims_prefers_most_recently_used(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 7))
    commit(core, ctx, 2, (1, 2, 8))
    assert lookup(core, ctx, (1, 2, 5)).entry_id == 2
    assert hit(lookup(core, ctx, (1, 2, 7, 0))) == (1, 3, ReusePath.EXACT)  # touches entry 1
    assert lookup(core, ctx, (1, 2, 5)).entry_id == 1


def test_whole_entries_with_same_tokens_tie_on_recency(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2), namespace="a")
    commit(core, ctx, 2, (1, 2), namespace="a", trimmable=False)
    commit(core, ctx, 3, (1, 2), namespace="b", trimmable=False)
    commit(core, ctx, 4, (1, 2), namespace="b")
    assert hit(lookup(core, ctx, (1, 2, 5), namespace="a")) == (2, 2, ReusePath.CHECKPOINT)
    assert hit(lookup(core, ctx, (1, 2, 5), namespace="b")) == (4, 2, ReusePath.EXACT)


def test_removed_entry_is_never_found_through_a_surviving_sibling(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 4), pinned=True)
    commit(core, ctx, 2, (1, 2, 3))  # the most recent entry below (1, 2)
    core.handle(Evict(nbytes=1), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(2,), spill=True))]
    assert hit(lookup(core, ctx, (1, 2, 9))) == (1, 2, ReusePath.TRIM)


# --------------------------------------------------------------------------- isolation


def test_namespaces_never_share(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2, 3), namespace="a")
    assert lookup(core, ctx, (1, 2, 3, 4), namespace="b").path is ReusePath.MISS
    assert commit(core, ctx, 2, (1, 2, 3), namespace="b").accepted
    assert lookup(core, ctx, (1, 2, 3, 4), namespace="b").entry_id == 2


def test_epochs_never_share(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2, 3), epoch=1)
    assert lookup(core, ctx, (1, 2, 3, 4), epoch=2).path is ReusePath.MISS


# --------------------------------------------------------------------------- eviction


def test_a_taken_lease_forgets_its_entry_at_once_without_a_drop(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    """A branch near the end: the hit is leased and marked takeable; the engine takes it at its
    restore (``ReleaseLease(take=True)``), and the entry's bytes leave the total at once, no
    later lookup finds it, and no DropEntries follows (the engine holds its state now)."""
    commit(core, ctx, 1, (1, 2, 3, 4, 5), nbytes=50)
    commit(core, ctx, 2, (9, 9), nbytes=20)
    takeable = lookup(core, ctx, (1, 2, 3, 7), take_within=2)
    assert hit(takeable) == (1, 3, ReusePath.TRIM)
    assert takeable.takeable
    assert takeable.lease_id is not None
    assert core.total_bytes == 70  # nothing leaves before the engine takes it
    core.handle(ReleaseLease(lease_id=takeable.lease_id, take=True), ENGINE, ctx)
    assert ctx.take_sent() == []
    assert [e.entry_id for e in core.entries()] == [2]
    assert core.total_bytes == 20
    assert hit(lookup(core, ctx, (1, 2, 3, 4, 5, 6))) == (None, 0, ReusePath.MISS)
    core.handle(Evict(nbytes=1000), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(2,), spill=True))]
    assert stats(core, ctx).counters["taken"] == 1


def test_a_takeable_entry_released_without_take_stays_cached(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    """The engine copied it instead (another of its sequences held or awaited it): a plain
    release leaves the entry as it was."""
    commit(core, ctx, 1, (1, 2, 3, 4, 5), nbytes=50)
    takeable = lookup(core, ctx, (1, 2, 3, 4, 5, 6), take_within=2)
    assert takeable.takeable and takeable.lease_id is not None
    core.handle(ReleaseLease(lease_id=takeable.lease_id), ENGINE, ctx)
    assert ctx.take_sent() == []
    assert [e.entry_id for e in core.entries()] == [1]
    assert (core.total_bytes, stats(core, ctx).counters["taken"]) == (50, 0)


def test_a_take_voids_the_other_leases_on_its_entry(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    """A lookup that leased the entry after the engine decided to take it (the take was on its
    way): the take wins, the late lease is void and its release is a counted dead letter."""
    commit(core, ctx, 1, (1, 2, 3, 4, 5))
    first = lookup(core, ctx, (1, 2, 3, 4, 5, 6), sequence_id=1, take_within=2)
    late = lookup(core, ctx, (1, 2, 3, 4, 5, 7), sequence_id=2, take_within=2)
    assert first.lease_id is not None and late.lease_id is not None
    core.handle(ReleaseLease(lease_id=first.lease_id, take=True), ENGINE, ctx)
    assert core.entries() == () and core.total_bytes == 0
    core.handle(ReleaseLease(lease_id=late.lease_id), ENGINE, ctx)
    assert ctx.take_sent() == []
    assert stats(core, ctx).counters["unknown_lease_releases"] == 1


def test_a_pinned_or_too_long_entry_is_not_takeable(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3, 4, 5))
    assert not lookup(core, ctx, (1, 2, 3, 4, 5, 6), sequence_id=1).takeable  # take_within -1
    second = lookup(core, ctx, (1, 2, 3, 4, 5, 7), sequence_id=2, take_within=10)
    # Held by another lease, still takeable: whether others hold it is the engine's to judge.
    assert (second.takeable, second.lease_id is not None) == (True, True)
    commit(core, ctx, 3, (6, 6, 6), pinned=True)  # a session's instructions prefix
    assert not lookup(core, ctx, (6, 6, 6, 1), take_within=10).takeable
    commit(core, ctx, 4, (7, 7, 7, 7, 7))
    too_long = lookup(core, ctx, (7, 7, 1), take_within=2)  # 3 tokens past the reuse point
    assert (too_long.takeable, hit(too_long)) == (False, (4, 2, ReusePath.TRIM))
    assert lookup(core, ctx, (7, 7, 7, 7, 7, 1), take_within=0).takeable
    assert len(core.entries()) == 3


def test_lease_protects_entry_from_eviction(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2, 3))
    commit(core, ctx, 2, (4, 5, 6))
    lease = lookup(core, ctx, (1, 2, 3, 4)).lease_id
    assert lease is not None
    core.handle(Evict(nbytes=1000), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(2,), spill=True))]
    assert [e.entry_id for e in core.entries()] == [1]

    core.handle(ReleaseLease(lease_id=lease), ENGINE, ctx)
    core.handle(Evict(nbytes=1000), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(1,), spill=True))]
    assert core.total_bytes == 0


def test_evicts_least_recently_used_first(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    for entry_id, first_token in [(1, 1), (2, 2), (3, 3)]:
        commit(core, ctx, entry_id, (first_token, 0), nbytes=10)
    lease = lookup(core, ctx, (1, 0, 0)).lease_id  # entry 1 becomes most recent
    core.handle(ReleaseLease(lease_id=lease or 0), ENGINE, ctx)
    core.handle(Evict(nbytes=15), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(2, 3), spill=True))]
    stats_reply = stats(core, ctx)
    assert stats_reply.counters["evictions"] == 2
    assert stats_reply.counters["evicted_bytes"] == 20


def test_pinned_entries_evicted_only_when_asked(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2), pinned=True)
    core.handle(Evict(nbytes=10), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == []
    core.handle(Evict(nbytes=10, include_pinned=True), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(1,), spill=True))]


def test_evict_sends_one_drop_per_engine(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2), epoch=1)
    commit(core, ctx, 1, (1, 2), epoch=2)
    commit(core, ctx, 2, (3, 4), epoch=1)
    core.handle(Evict(nbytes=30), PREFIX_CACHE, ctx)
    assert ctx.take_sent() == [
        (engine_address(MODEL, 1), DropEntries(epoch=1, entry_ids=(1, 2), spill=True)),
        (engine_address(MODEL, 2), DropEntries(epoch=2, entry_ids=(1,), spill=True)),
    ]


# --------------------------------------------------------------------------- commit rules


def test_supersede_spares_leased_pinned_and_checkpoint_entries(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2))
    assert commit(core, ctx, 2, (1, 2, 3), trimmable=False).superseded == ()
    assert commit(core, ctx, 3, (1, 2, 3, 4), pinned=True).superseded == (1,)
    assert commit(core, ctx, 4, (1, 2, 3, 4, 5)).superseded == ()  # 3 is pinned
    assert lookup(core, ctx, (1, 2, 3, 4, 5, 6)).entry_id == 4

    assert commit(core, ctx, 5, (1, 2, 3, 4, 5, 6, 7)).superseded == ()  # 4 is leased
    assert sorted(e.entry_id for e in core.entries()) == [2, 3, 4, 5]


def test_supersede_reports_dropped_entries_without_drop_message(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1,), nbytes=5)
    commit(core, ctx, 2, (1, 2), nbytes=7)  # supersedes 1
    reply = commit(core, ctx, 3, (1, 2, 3), nbytes=11)
    assert reply == Committed(entry_id=3, accepted=True, superseded=(2,))
    assert [e.entry_id for e in core.entries()] == [3]
    assert core.total_bytes == 11
    assert ctx.take_sent() == []
    # A non-trimmable commit supersedes nothing.
    assert commit(core, ctx, 4, (1, 2, 3, 4), trimmable=False).superseded == ()
    assert stats(core, ctx).counters["superseded"] == 2


def test_duplicate_and_empty_commits_refused(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    assert commit(core, ctx, 1, (1, 2, 3)).accepted
    assert not commit(core, ctx, 2, (1, 2, 3)).accepted
    assert commit(core, ctx, 3, (1, 2, 3), trimmable=False).accepted
    assert not commit(core, ctx, 4, (1, 2, 3), trimmable=False).accepted
    assert not commit(core, ctx, 5, ()).accepted
    assert not commit(core, ctx, 1, (9, 9)).accepted  # entry id already in use
    assert sorted(e.entry_id for e in core.entries()) == [1, 3]
    assert core.total_bytes == 20
    counters = stats(core, ctx).counters
    assert (counters["commits"], counters["commits_refused"]) == (2, 4)


def test_commit_from_before_reset_is_refused(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    seen = lookup(core, ctx, (1, 2, 3)).generation
    core.handle(ResetPrefixes(model=MODEL, namespace="a"), ROUTER, ctx)
    ctx.take_sent()
    assert not commit(core, ctx, 1, (1, 2, 3), generation=seen).accepted
    assert lookup(core, ctx, (1, 2, 3)).generation == seen + 1
    assert commit(core, ctx, 2, (1, 2, 3), generation=seen + 1).accepted
    # Another namespace was not reset, so its old generation is still current.
    assert commit(core, ctx, 3, (1, 2, 3), namespace="b", generation=seen).accepted


def test_model_wide_reset_bumps_every_namespace(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    core.handle(ResetPrefixes(model=MODEL, namespace="a"), ROUTER, ctx)
    core.handle(ResetPrefixes(model=MODEL), ROUTER, ctx)
    ctx.take_sent()
    assert core.generation(MODEL, "a") == 2
    assert core.generation(MODEL, "never-seen") == 1
    assert core.generation("other", "a") == 0
    assert not commit(core, ctx, 1, (1, 2), namespace="b", generation=0).accepted


# --------------------------------------------------------------------------- reset and teardown


def test_reset_drops_unleased_and_dooms_leased(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3))
    commit(core, ctx, 2, (4, 5, 6))
    commit(core, ctx, 3, (1, 2, 3), namespace="b")
    commit(core, ctx, 1, (1, 2, 3), model="other", epoch=1)
    lease = lookup(core, ctx, (1, 2, 3, 4)).lease_id
    assert lease is not None

    core.handle(ResetPrefixes(model=MODEL, namespace="a"), ROUTER, ctx)
    assert ctx.take_sent() == [
        (ENGINE, DropEntries(epoch=1, entry_ids=(2,))),
        (ROUTER, PrefixesReset(model=MODEL, dropped=2)),
    ]
    doomed = [e for e in core.entries() if e.doomed]
    assert [(e.entry_id, e.leases) for e in doomed] == [(1, 1)]
    assert lookup(core, ctx, (1, 2, 3, 4)).path is ReusePath.MISS
    assert lookup(core, ctx, (1, 2, 3, 4), namespace="b").entry_id == 3

    # The doomed entry survives eviction and a second reset does not count it again.
    core.handle(Evict(nbytes=1000, include_pinned=True), PREFIX_CACHE, ctx)
    core.handle(ResetPrefixes(model=MODEL, namespace="a"), ROUTER, ctx)
    assert ctx.take_sent()[-1] == (ROUTER, PrefixesReset(model=MODEL, dropped=0))
    assert EntryKey(MODEL, 1, 1) in core.leased_entry_ids()

    core.handle(ReleaseLease(lease_id=lease), ENGINE, ctx)
    assert ctx.take_sent() == [(ENGINE, DropEntries(epoch=1, entry_ids=(1,)))]
    assert stats(core, ctx).gauges["doomed"] == 0


def test_invalidate_epoch_forgets_silently(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2, 3), epoch=1, nbytes=10)
    commit(core, ctx, 2, (4, 5), epoch=1, nbytes=10)
    commit(core, ctx, 1, (1, 2, 3), epoch=2, nbytes=5)
    lease = lookup(core, ctx, (1, 2, 3, 4), epoch=1).lease_id
    assert lease is not None

    core.handle(InvalidateEpoch(model=MODEL, epoch=1), ROUTER, ctx)
    assert ctx.take_sent() == []
    assert [(e.epoch, e.entry_id) for e in core.entries()] == [(2, 1)]
    assert core.total_bytes == 5
    assert core.leased_entry_ids() == frozenset()

    core.handle(ReleaseLease(lease_id=lease), ENGINE, ctx)
    assert ctx.take_sent() == []
    assert ctx.dead_letters["prefix_unknown_lease"] == 1
    assert not commit(core, ctx, 3, (7, 8), epoch=1).accepted
    assert lookup(core, ctx, (1, 2, 3, 4), epoch=2).entry_id == 1


# --------------------------------------------------------------------------- leases and stats


def test_lease_ids_are_never_reused(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2))
    seen: set[int | None] = set()
    for _ in range(3):
        lease = lookup(core, ctx, (1, 2, 3)).lease_id
        assert lease not in seen
        seen.add(lease)
        core.handle(ReleaseLease(lease_id=lease or 0), ENGINE, ctx)
    assert core.leased_entry_ids() == frozenset()
    core.handle(ReleaseLease(lease_id=max(i or 0 for i in seen)), ENGINE, ctx)
    assert ctx.dead_letters["prefix_unknown_lease"] == 1


def test_stats_count_every_outcome(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    commit(core, ctx, 1, (1, 2, 3), nbytes=10)
    commit(core, ctx, 2, (5, 6), trimmable=False, nbytes=4)
    lookup(core, ctx, (1, 2, 3, 4))  # exact, 3 reused
    lookup(core, ctx, (1, 2, 9))  # trim, 2 reused
    lookup(core, ctx, (5, 6, 7))  # checkpoint, 2 reused
    lookup(core, ctx, (8, 8))  # miss
    core.handle(ResetPrefixes(model=MODEL), ROUTER, ctx)
    ctx.take_sent()

    reply = stats(core, ctx)
    assert reply.actor == "prefix"
    counters = reply.counters
    assert counters["lookups"] == 4
    assert (counters["hits_exact"], counters["hits_trim"], counters["hits_checkpoint"]) == (1, 1, 1)
    assert counters["misses"] == 1
    assert counters["tokens_reused"] == 7
    assert (counters["commits"], counters["resets"]) == (2, 1)
    assert reply.gauges == {"entries": 2, "bytes": 14, "leases": 3, "doomed": 2}
    assert core.statistics() == reply


def test_unexpected_message_is_a_dead_letter(core: PrefixCacheCore, ctx: RecordingContext) -> None:
    core.handle(PrefixesReset(model=MODEL, dropped=0), ROUTER, ctx)
    assert ctx.take_sent() == []
    assert ctx.dead_letters["prefix_unexpected_message"] == 1
    core.on_start(ctx)
    core.on_stop(ctx)


def test_a_lookup_the_keeper_sent_on_is_answered_to_its_engine(
    core: PrefixCacheCore, ctx: RecordingContext
) -> None:
    commit(core, ctx, 1, (1, 2, 3))
    sent_on = Lookup(model=MODEL, epoch=1, namespace="a", tokens=(1, 2, 3, 4), sequence_id=9,
                     reply_to=ENGINE)  # fmt: skip
    core.handle(sent_on, "kv", ctx)

    [(to, reply)] = ctx.take_sent()
    assert to == ENGINE  # not the keeper that sent it
    assert isinstance(reply, LookupResult) and hit(reply) == (1, 3, ReusePath.EXACT)
