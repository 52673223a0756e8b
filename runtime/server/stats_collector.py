"""The runtime's own counters and gauges as Prometheus metric families, read at scrape time.

``RuntimeCollector`` turns a fresh ``Runtime.stats()`` snapshot into families on every scrape; it
keeps no copy of the runtime's state except the last counters of each engine, so that a model's
totals survive its engine being replaced (see ``EngineTotals``). The metrics are listed in
docs/http.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from actors.router import ENGINES_FAILED_OF
from runtime.host.api import RuntimeStats
from runtime.kernel.core import engine_model
from runtime.messages import ReusePath, ReuseTier, Stats

EngineStats = tuple[str, Stats]  # an engine's model, and its stats
# Engine counters shown per model: (metric name without mlxrt_ and _total, help, engine counter).
_ENGINE_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "prefilled_tokens",
        "Prompt tokens the engine prefilled (requests and prewarms; cached ones are not).",
        "prefilled_tokens",
    ),
    (
        "reused_prompt_tokens",
        "Prompt tokens taken from the prefix cache instead of prefilled (requests and prewarms).",
        "cached_prompt_tokens",
    ),
    ("decoded_tokens", "Tokens the engine fed through decode steps.", "decoded_tokens"),
    ("aborts", "Sequences the engine cancelled (superseded, disconnected, ...).", "cancelled"),
    ("admission_waits", "Admissions that waited for a KV reservation.", "admission_waits"),
    (
        "speculative_passes",
        "Speculative verification passes (prompt lookup).",
        "speculative_passes",
    ),
    ("drafted_tokens", "Draft tokens verification passes fed.", "drafted_tokens"),
    ("disk_hits", "Lookups the prefix cache's disk tier served.", "disk_hits"),
    ("disk_load_ms", "Milliseconds spent reading disk-tier entries back.", "disk_load_ms"),
    ("disk_spills", "Evicted (or unloaded) prefix entries written to disk.", "disk_spills"),
    ("disk_dropped", "Disk-tier files that failed a check and were deleted.", "disk_dropped"),
    ("disk_write_failures", "Disk-tier writes that failed (a full disk).", "disk_write_failed"),
    (
        "accepted_tokens",
        "Draft tokens accepted (their rate: accepted_tokens / drafted_tokens).",
        "accepted_tokens",
    ),
)


class EngineTotals:
    """Engine counters summed per model over every engine (epoch) this scraper has seen.

    A restart or an unload replaces or removes an engine and its counters with it; a Prometheus
    counter must never go down, so the last counters seen of a gone engine are kept as the model's
    retired total. What a gone engine counted after the last scrape is not seen (an undercount,
    never a decrease).
    """

    def __init__(self) -> None:
        self._last_seen: dict[str, tuple[str, dict[str, int]]] = {}
        self._retired: dict[str, Counter[str]] = {}

    def update(self, engines: dict[str, EngineStats]) -> dict[str, Counter[str]]:
        """Take the live engines' stats (by address); return each model's totals."""
        for address in self._last_seen.keys() - engines.keys():
            model, counters = self._last_seen.pop(address)
            self._retired.setdefault(model, Counter()).update(counters)
        totals = {model: Counter(retired) for model, retired in self._retired.items()}
        for address, (live_model, stats) in engines.items():
            self._last_seen[address] = (live_model, dict(stats.counters))
            totals.setdefault(live_model, Counter()).update(stats.counters)
        return totals


class RuntimeCollector(Collector):
    """Families made from ``read_stats()`` at each scrape; nothing while it returns None.

    Scrape on the event loop (the ``/metrics`` route does): ``Runtime.stats()`` reads the actors'
    state between messages, which another thread cannot do safely.
    """

    def __init__(self, read_stats: Callable[[], RuntimeStats | None]) -> None:
        self._read_stats = read_stats
        self._engine_totals = EngineTotals()

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        if stats is None:
            return
        engines = {
            address: (model, actor_stats)
            for address, actor_stats in stats.actors.items()
            if (model := engine_model(address)) is not None
        }
        yield from _engine_families(self._engine_totals.update(engines), engines)
        if (kv := stats.actors.get("kv")) is not None:
            yield from _kv_families(kv)
        if (router := stats.actors.get("router")) is not None:
            yield from _router_families(router)


def _engine_families(
    totals: dict[str, Counter[str]], live: dict[str, EngineStats]
) -> Iterator[Metric]:
    for name, documentation, counter in _ENGINE_COUNTERS:
        family = CounterMetricFamily(f"mlxrt_{name}", documentation, labels=["model"])
        for model, counts in sorted(totals.items()):
            family.add_metric([model], counts[counter])
        yield family
    reuse = CounterMetricFamily(
        "mlxrt_prefix_reuse",
        "Admissions by the prefix-reuse path they took (miss: prefilled from the start).",
        labels=["model", "path"],
    )
    for model, counts in sorted(totals.items()):
        for path in ReusePath:  # every path, at zero until taken: a rate needs a first sample
            reuse.add_metric([model, path.value], counts[f"path_{path}"])
    yield reuse
    tiers = CounterMetricFamily(
        "mlxrt_prefix_tier",
        "Requests by where their reused prompt state came from (cold: nothing reused).",
        labels=["model", "tier"],
    )
    for model, counts in sorted(totals.items()):
        for tier in ReuseTier:
            tiers.add_metric([model, tier.value], counts[f"tier_{tier}"])
    yield tiers
    disk = GaugeMetricFamily(
        "mlxrt_disk_cache_bytes", "Bytes of the model's disk-tier files.", labels=["model"]
    )
    disk_entries = GaugeMetricFamily(
        "mlxrt_disk_cache_entries", "Files in the model's disk tier.", labels=["model"]
    )
    for model, stats in sorted({m: s for m, s in live.values()}.items()):
        if "disk_entries" in stats.gauges:
            disk.add_metric([model], stats.gauges["disk_bytes"])
            disk_entries.add_metric([model], stats.gauges["disk_entries"])
    yield disk
    yield disk_entries
    batch = GaugeMetricFamily(
        "mlxrt_batch_size", "Sequences in the model's decode batch now.", labels=["model"]
    )
    sequences = GaugeMetricFamily(
        "mlxrt_engine_sequences", "Sequences the model's engine holds now.", labels=["model"]
    )
    # An unloading or failed epoch may still drain beside its successor: one sample per model.
    batch_sizes: Counter[str] = Counter()
    sequence_counts: Counter[str] = Counter()
    for model, stats in live.values():
        batch_sizes[model] += stats.gauges.get("batch_size", 0)
        sequence_counts[model] += stats.gauges.get("sequences", 0)
    for model in sorted(batch_sizes):
        batch.add_metric([model], batch_sizes[model])
        sequences.add_metric([model], sequence_counts[model])
    yield batch
    yield sequences
    capability = GaugeMetricFamily(
        "mlxrt_model_capability",
        "1 where the load probe found the capability exact on the model, 0 where it is off.",
        labels=["model", "capability"],
    )
    # One sample per model: epochs of one model share its fingerprint, so its verdicts.
    current = {model: stats for model, stats in live.values()}
    for model, stats in sorted(current.items()):
        for key, on in sorted(stats.gauges.items()):
            if key.startswith("capability_"):
                capability.add_metric([model, key.removeprefix("capability_")], on)
    yield capability


def _kv_families(kv: Stats) -> Iterator[Metric]:
    gauges = kv.gauges
    yield GaugeMetricFamily(
        "mlxrt_kv_budget_bytes", "The KV memory budget.", value=gauges["budget"]
    )
    yield GaugeMetricFamily(
        "mlxrt_kv_reserved_bytes",
        "KV bytes reserved by requests and cached prefixes now.",
        value=gauges["reserved"],
    )
    yield GaugeMetricFamily(
        "mlxrt_kv_queued_requests",
        "Reservations waiting for KV memory now (the admission queue).",
        value=gauges["queued"],
    )
    yield GaugeMetricFamily(
        "mlxrt_kv_queued_bytes",
        "KV bytes the waiting reservations ask for.",
        value=gauges["queued_bytes"],
    )
    yield CounterMetricFamily(
        "mlxrt_kv_waits",
        "Reservations that had to wait for KV memory.",
        value=kv.counters.get("queued", 0),
    )
    # Per node once engines run on Ray nodes (each node's KV is budgeted on that node).
    for gauge, documentation in (
        ("node_budget", "The KV memory budget of one node (host: the host's own process)."),
        ("node_reserved", "KV bytes reserved on one node now."),
        ("node_queued", "Reservations waiting for one node's KV memory now."),
    ):
        family = GaugeMetricFamily(f"mlxrt_kv_{gauge}", documentation, labels=["node"])
        for key, value in sorted(gauges.items()):
            if key.startswith(f"{gauge}:"):
                family.add_metric([key.removeprefix(f"{gauge}:")], value)
        yield family


def _router_families(router: Stats) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "mlxrt_live_requests",
        "Requests and prewarms accepted and not yet ended.",
        value=router.gauges.get("live_requests", 0),
    )
    failures = CounterMetricFamily(
        "mlxrt_engine_failures",
        "Engines that failed (each is restarted while its restart intensity allows).",
        labels=["model"],
    )
    for key, count in sorted(router.counters.items()):
        if key.startswith(ENGINES_FAILED_OF):
            failures.add_metric([key.removeprefix(ENGINES_FAILED_OF)], count)
    yield failures
