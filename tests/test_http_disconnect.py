"""A client that goes away cancels its request at once: a real uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator

import anyio
import anyio.lowlevel
import httpx
import pytest

from bench.soak.http_soak import serve_on_loopback
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import engine_address
from runtime.messages import ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import ModelOption, sim_spec, wait_until

pytestmark = pytest.mark.anyio

CHUNK = 8


def sim_model(**options: ModelOption) -> ModelSpec:
    return sim_spec(chunk=CHUNK, **options)


@contextlib.asynccontextmanager
async def live_server(model: ModelSpec) -> AsyncIterator[tuple[httpx.AsyncClient, Runtime]]:
    """uvicorn serving the app on an ephemeral loopback port, and a client for it."""
    runtime = RuntimeConfig(kv_budget_bytes=64 << 20)
    server = OpenAIServer(ServerConfig(models=(model,), runtime=runtime))
    timeout = httpx.Timeout(5.0)  # httpx's default
    async with serve_on_loopback(server, start_within_s=10, client_timeout=timeout) as client:
        yield client, server.runtime


def engine_counter(rt: Runtime, name: str) -> int:
    # The server's lifespan loaded the one model on a fresh runtime: its first epoch.
    return rt.stats().actors[engine_address("m", 1)].counters.get(name, 0)


def only_prefix_entries_hold_kv(rt: Runtime) -> bool:
    actors = rt.stats().actors
    return actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]


async def test_a_client_gone_mid_stream_cancels_its_request_and_frees_its_kv() -> None:
    body = {"model": "m", "prompt": "go on", "max_tokens": 2000, "temperature": 0, "stream": True}
    async with live_server(sim_model(decode_s_per_token=0.005)) as (client, rt):
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        await wait_until(rt, lambda: engine_counter(rt, "cancelled") == 1)
        await wait_until(rt, lambda: only_prefix_entries_hold_kv(rt))
        assert engine_counter(rt, "finished") == 0
        assert rt.stats().actors["router"].gauges["live_requests"] == 0
        body.update(stream=False, max_tokens=2)
        after = await client.post("/v1/completions", json=body)
        assert after.status_code == 200  # the server goes on


async def test_a_client_gone_mid_prefill_cancels_a_non_streaming_request() -> None:
    prompt_tokens = 2000  # 4 s of prefill if it ran to the end
    body = {"model": "m", "prompt": "x" * prompt_tokens, "max_tokens": 4}
    async with live_server(sim_model(prefill_s_per_token=0.002)) as (client, rt):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(client.post, "/v1/completions", json=body))
            await wait_until(rt, lambda: engine_counter(rt, "prefilled_tokens") > 0)
            tg.cancel_scope.cancel()  # the client gives up: its connection closes
        await wait_until(rt, lambda: engine_counter(rt, "cancelled") == 1)
        assert engine_counter(rt, "prefilled_tokens") < prompt_tokens
        await wait_until(rt, lambda: only_prefix_entries_hold_kv(rt))
        assert rt.stats().actors["router"].gauges["live_requests"] == 0
