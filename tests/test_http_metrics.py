"""``GET /metrics``: Prometheus exposition of the server and the runtime, parsed by
prometheus-client's own parser. Simulated backend through httpx's ASGI transport, as
tests/test_http_server.py."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from runtime.host.config import RuntimeConfig
from runtime.kernel.core import engine_address
from runtime.messages import ModelSpec, Stats, TokensEmitted, Usage
from runtime.server import OpenAIServer, ServerConfig
from runtime.server.metrics import ServerMetrics
from runtime.server.stats_collector import EngineTotals, _router_families
from runtime.testing.harness import ModelOption, sim_spec, wait_until

pytestmark = pytest.mark.anyio

Json = dict[str, Any]
Labels = tuple[tuple[str, str], ...]
BUDGET = 64 << 20


def sim_model(**options: ModelOption) -> ModelSpec:
    return sim_spec("m", chunk=8, **options)


@contextlib.asynccontextmanager
async def serving(model: ModelSpec) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    config = RuntimeConfig(kv_budget_bytes=BUDGET)
    server = OpenAIServer(ServerConfig(models=(model,), runtime=config))
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, server


class Scrape:
    """One ``GET /metrics``, parsed: each sample's value by its name and labels."""

    def __init__(self, text: str) -> None:
        self.types: dict[str, str] = {}
        self.samples: dict[tuple[str, Labels], float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                assert key not in self.samples, f"duplicate sample {key}"
                self.samples[key] = sample.value

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, tuple(sorted(labels.items())))]


async def scrape(client: httpx.AsyncClient) -> Scrape:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE_LATEST
    return Scrape(response.text)


def engine_counter(server: OpenAIServer, name: str) -> int:
    return server.runtime.stats().actors[engine_address("m", 1)].counters.get(name, 0)


async def complete(client: httpx.AsyncClient, prompt: str, **body: object) -> httpx.Response:
    return await client.post(
        "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0, **body},
    )


async def test_requests_tokens_reuse_and_kv_are_exposed_in_prometheus_format() -> None:
    warm: dict[str, httpx.Response] = {}

    async def prewarm(name: str, prompt: str) -> None:
        body = {"model": "m", "prompt": prompt, "session": "editor"}
        warm[name] = await client.post("/v1/prewarm", json=body)

    def prefilled_over(tokens: int) -> bool:
        return engine_counter(server, "prefilled_tokens") > tokens

    async with serving(sim_model(prefill_s_per_token=0.002)) as (client, server):
        await prewarm("w", "w" * 40)
        reused = await complete(client, "w" * 40 + "!", stream=True)
        plain = await complete(client, "hello there")
        # The session's newer prewarm supersedes the older one mid-prefill.
        async with anyio.create_task_group() as tg:
            tg.start_soon(prewarm, "old", "z" * 300)
            await wait_until(server.runtime, functools.partial(prefilled_over, 100))
            tg.start_soon(prewarm, "new", "q" * 20)
        # A client that goes away mid-prefill: its request is cancelled.
        async with anyio.create_task_group() as tg:
            tg.start_soon(complete, client, "y" * 300)
            await wait_until(server.runtime, functools.partial(prefilled_over, 400))
            tg.cancel_scope.cancel()
        unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        await wait_until(server.runtime, lambda: engine_counter(server, "cancelled") == 2)
        metrics = await scrape(client)
        stats = server.runtime.stats()

    assert reused.status_code == plain.status_code == 200 and unknown.status_code == 404
    assert [warm[name].json()["status"] for name in ("w", "old", "new")] == [
        "prewarmed",
        "superseded",
        "prewarmed",
    ]
    assert metrics.types["mlxrt_requests"] == "counter"
    assert metrics.value("mlxrt_requests_total", model="m", outcome="finished") == 2
    assert metrics.value("mlxrt_requests_total", model="m", outcome="disconnected") == 1
    assert metrics.value("mlxrt_requests_total", model="m", outcome="failed") == 0
    assert metrics.value("mlxrt_requests_total", model="(unknown)", outcome="rejected") == 1
    assert metrics.value("mlxrt_prewarms_total", model="m", outcome="prewarmed") == 2
    assert metrics.value("mlxrt_prewarms_total", model="m", outcome="superseded") == 1
    # Every finished stream got a first token; the one that was cut off never did.
    assert metrics.types["mlxrt_time_to_first_token_seconds"] == "histogram"
    assert metrics.value("mlxrt_time_to_first_token_seconds_count", model="m") == 2
    # Each request decoded 4 tokens: 3 after the first one, each with its gap.
    assert metrics.value("mlxrt_inter_token_latency_seconds_count", model="m") == 2 * 3

    # The finished requests' usage; only the one after the first prewarm reused a prefix (the
    # prewarms reused nothing), so the engine's count of reused tokens is all its own.
    engine = stats.actors[engine_address("m", 1)].counters
    assert metrics.value("mlxrt_completion_tokens_total", model="m") == 8
    assert metrics.value("mlxrt_prompt_tokens_total", model="m") == 41 + len("hello there")
    reused_tokens = engine["cached_prompt_tokens"]
    assert metrics.value("mlxrt_cached_prompt_tokens_total", model="m") == reused_tokens > 0
    assert metrics.value("mlxrt_reused_prompt_tokens_total", model="m") == reused_tokens
    assert metrics.value("mlxrt_prefilled_tokens_total", model="m") == engine["prefilled_tokens"]
    assert metrics.value("mlxrt_decoded_tokens_total", model="m") == engine["decoded_tokens"]
    assert metrics.value("mlxrt_prefix_reuse_total", model="m", path="exact") == 1
    assert metrics.value("mlxrt_prefix_reuse_total", model="m", path="trim") == 0
    assert metrics.value("mlxrt_prefix_reuse_total", model="m", path="miss") == engine["path_miss"]
    assert metrics.value("mlxrt_aborts_total", model="m") == 2
    assert metrics.value("mlxrt_kv_budget_bytes") == BUDGET
    assert metrics.value("mlxrt_kv_reserved_bytes") == stats.actors["kv"].gauges["reserved"] > 0
    assert metrics.value("mlxrt_batch_size", model="m") == 0
    assert metrics.value("mlxrt_live_requests") == 0
    assert not any(name == "mlxrt_engine_failures_total" for name, _ in metrics.samples)
    assert metrics.types["mlxrt_kv_waits"] == "counter"


async def test_a_models_counters_survive_its_reload() -> None:
    async with serving(sim_model()) as (client, server):
        assert (await complete(client, "first load")).status_code == 200
        before = await scrape(client)
        await server.runtime.unload_model("m")
        unloaded = await scrape(client)
        await server.runtime.load_model(sim_model())
        assert (await complete(client, "second load")).status_code == 200
        after = await scrape(client)

    # Engine counters: the first load's engine is gone, its counts are not.
    first = before.value("mlxrt_prefilled_tokens_total", model="m")
    assert first == len("first load")
    assert unloaded.value("mlxrt_prefilled_tokens_total", model="m") == first
    assert after.value("mlxrt_prefilled_tokens_total", model="m") == first + len("second load")


def test_engine_totals_keep_a_gone_engines_counts_and_sum_epochs() -> None:
    totals = EngineTotals()
    first = Stats(actor="engine:a#1", counters={"decoded_tokens": 5})
    assert totals.update({"engine:a#1": ("a", first)})["a"]["decoded_tokens"] == 5
    assert totals.update({})["a"]["decoded_tokens"] == 5
    second = Stats(actor="engine:a#2", counters={"decoded_tokens": 2})
    assert totals.update({"engine:a#2": ("a", second)})["a"]["decoded_tokens"] == 7


async def test_two_servers_in_one_process_keep_their_own_registries() -> None:
    async with serving(sim_model()) as (one, _), serving(sim_model()) as (two, _):
        assert (await complete(one, "only on the first")).status_code == 200
        first, second = await scrape(one), await scrape(two)
    assert first.value("mlxrt_requests_total", model="m", outcome="finished") == 1
    assert second.value("mlxrt_requests_total", model="m", outcome="finished") == 0


async def test_metrics_before_start_up_show_the_server_side_only() -> None:
    server = OpenAIServer(ServerConfig(models=(sim_model(),)))
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        metrics = await scrape(client)
    assert "mlxrt_requests" in metrics.types and "mlxrt_kv_budget_bytes" not in metrics.types


def test_a_stream_timer_splits_a_gap_over_the_tokens_it_brought() -> None:
    now = [10.0]
    metrics = ServerMetrics(lambda: None, clock=lambda: now[0])
    timer = metrics.stream_timer("m")

    def emitted(*token_ids: int) -> TokensEmitted:
        return TokensEmitted(request_id="r", incarnation=1, token_ids=token_ids, text="")

    now[0] = 12.0
    timer.tokens_emitted(emitted(1, 2))  # the first token after 2 s, another with it
    now[0] = 13.0
    timer.tokens_emitted(emitted(3, 4))  # two tokens after 1 s: 0.5 s each
    timer.ended("finished", Usage(prompt_tokens=5, cached_prompt_tokens=3, completion_tokens=4))
    timer.ended("cancelled")  # a stream counts once

    scraped = Scrape(metrics.exposition().decode())
    assert scraped.value("mlxrt_time_to_first_token_seconds_count", model="m") == 1
    assert scraped.value("mlxrt_time_to_first_token_seconds_sum", model="m") == 2.0
    assert scraped.value("mlxrt_inter_token_latency_seconds_count", model="m") == 3
    assert scraped.value("mlxrt_inter_token_latency_seconds_sum", model="m") == 1.0
    assert scraped.value("mlxrt_inter_token_latency_seconds_bucket", model="m", le="0.5") == 3
    assert scraped.value("mlxrt_requests_total", model="m", outcome="finished") == 1
    assert ("mlxrt_requests_total", (("model", "m"), ("outcome", "cancelled"))) not in (
        scraped.samples
    )
    assert scraped.value("mlxrt_prompt_tokens_total", model="m") == 5
    assert scraped.value("mlxrt_cached_prompt_tokens_total", model="m") == 3
    assert scraped.value("mlxrt_completion_tokens_total", model="m") == 4


def test_engine_failures_are_counted_per_model() -> None:
    counts = {"engines_failed": 3, "engines_failed:a": 2, "engines_failed:b": 1}
    router_stats = Stats(actor="router", counters=counts)
    [failures] = [f for f in _router_families(router_stats) if f.name == "mlxrt_engine_failures"]
    assert failures.type == "counter"
    by_model = {(s.labels["model"], s.value) for s in failures.samples if s.name.endswith("_total")}
    assert by_model == {("a", 2), ("b", 1)}


async def test_a_model_with_replicas_is_exposed_per_replica() -> None:
    model = msgspec.structs.replace(sim_model(), replicas=2)
    async with serving(model) as (client, _):
        async with anyio.create_task_group() as tg:  # two at once: one on each replica
            for prompt in ("first prompt", "second prompt"):
                tg.start_soon(functools.partial(complete, client, prompt, max_tokens=30))
        metrics = await scrape(client)
        decoded = {
            replica: metrics.value("mlxrt_decoded_tokens_total", model=replica)
            for replica in ("m@0", "m@1")
        }
        assert decoded["m@0"] == decoded["m@1"] > 0, decoded  # each replica decoded one
