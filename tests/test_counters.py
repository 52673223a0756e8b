"""Every actor counts with ``runtime.kernel.stats.Counters``; declared names read zero from the
start, which the keeper's and the prefix manager's ``Stats`` replies rely on."""

from __future__ import annotations

from actors.kv_budget import KVBudgetCore
from actors.prefix_cache import PrefixCacheCore
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE
from runtime.kernel.stats import Counters
from runtime.messages import Evict, GetStats, Holder, HolderKind, Release, Stats
from runtime.testing.recording import RecordingContext

KV_NAMES = [
    "granted", "queued", "evict_requests", "refused_invalid", "refused_too_large",
    "refused_timeout", "refused_no_wait", "released", "released_unknown", "transfers",
    "transfer_short", "transfer_invalid", "transfer_unknown_source", "dropped_waiting",
    "stale_timer", "stale_epoch", "unexpected_message", "evict_pinned_requests",
    "released_partial", "release_short", "release_invalid", "placements", "transfer_across_nodes",
    "lookups_sent_on",
]  # fmt: skip

PREFIX_NAMES = [
    "lookups", "hits_exact", "hits_trim", "hits_checkpoint", "misses", "taken", "tokens_reused",
    "commits", "commits_refused", "refused_stale_generation", "refused_invalidated_epoch",
    "refused_invalid", "refused_duplicate", "superseded", "lease_releases",
    "unknown_lease_releases", "evict_requests", "evict_shortfalls", "evictions", "evicted_bytes",
    "resets", "reset_entries", "invalidations", "invalidated_entries", "unpinned",
]  # fmt: skip

SEQUENCE = Holder(model="m", epoch=1, kind=HolderKind.SEQUENCE, id=1)


def test_declared_names_read_zero_and_come_first_in_order() -> None:
    counters = Counters(["b", "a"])
    counters.inc("late", 3)
    counters.inc("a")

    assert counters.snapshot() == {"b": 0, "a": 1, "late": 3}
    assert list(counters.snapshot()) == ["b", "a", "late"]
    assert counters["never"] == 0
    assert "never" not in counters.snapshot()  # reading a name does not declare it


def test_a_snapshot_does_not_change_with_later_counts() -> None:
    counters = Counters()
    counters.inc("x")
    before = counters.snapshot()
    counters.inc("x")

    assert before == {"x": 1}
    assert counters.snapshot() == {"x": 2}


def test_a_fresh_keeper_reports_every_counter_as_zero() -> None:
    ctx = RecordingContext(KV_KEEPER)
    KVBudgetCore(budget_bytes=100).handle(GetStats(), "host", ctx)

    [(_, reply)] = ctx.sent
    assert isinstance(reply, Stats)
    assert reply.counters == dict.fromkeys(KV_NAMES, 0)
    assert list(reply.counters) == KV_NAMES


def test_the_keeper_counts_into_its_declared_names() -> None:
    ctx = RecordingContext(KV_KEEPER)
    keeper = KVBudgetCore(budget_bytes=100)
    keeper.handle(Release(holder=SEQUENCE), "engine", ctx)

    counters = keeper.statistics().counters
    assert counters["released_unknown"] == 1
    assert list(counters) == KV_NAMES


def test_the_prefix_manager_reports_exactly_its_declared_counters() -> None:
    ctx = RecordingContext(PREFIX_CACHE)
    core = PrefixCacheCore()
    assert list(core.statistics().counters) == PREFIX_NAMES
    assert set(core.statistics().counters.values()) == {0}

    core.handle(Evict(nbytes=10), KV_KEEPER, ctx)

    counters = core.statistics().counters
    assert (counters["evict_requests"], counters["evict_shortfalls"]) == (1, 1)
    assert list(counters) == PREFIX_NAMES
