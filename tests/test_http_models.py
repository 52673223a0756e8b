"""Model management over HTTP, in-process (httpx's ASGI transport) on simulated models:
``GET /v1/models``, ``POST /v1/models/load`` and ``/unload``, keep-alive and auto-load."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import sim_spec, wait_until

pytestmark = pytest.mark.anyio
Json = dict[str, Any]


def sim_model(name: str = "m", keep_alive_s: float | None = None, **options: Any) -> ModelSpec:
    return msgspec.structs.replace(sim_spec(name, chunk=8, **options), keep_alive_s=keep_alive_s)


@contextlib.asynccontextmanager
async def serving(
    *models: ModelSpec, auto_load: bool = True
) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    runtime = RuntimeConfig(kv_budget_bytes=64 << 20, auto_load=auto_load)
    config = ServerConfig(models=models, runtime=runtime, offer_cached_models=False)
    server = OpenAIServer(config)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, server


async def models(client: httpx.AsyncClient) -> dict[str, Json]:
    listed = (await client.get("/v1/models")).json()
    assert listed["object"] == "list"
    return {card["id"]: card for card in listed["data"]}


async def complete(client: httpx.AsyncClient, model: str = "m") -> httpx.Response:
    body = {"model": model, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    return await client.post("/v1/completions", json=body)


def completed_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]  # type: ignore[no-any-return]


EXPECTED = bytes(greedy_continuation(list(b"hello"), 3)).decode()


def error_code(response: httpx.Response) -> str | None:
    return response.json()["error"]["code"]  # type: ignore[no-any-return]


def router_gauge(server: OpenAIServer, name: str) -> int:
    return server.runtime.stats().actors["router"].gauges[name]


async def test_the_list_shows_state_and_keep_alive_in_the_openai_shape() -> None:
    async with serving(sim_model("a", keep_alive_s=300.0), sim_model("b")) as (client, _):
        cards = await models(client)
        assert set(cards) == {"a", "b"}
        a, b = cards["a"], cards["b"]
        assert (a["object"], a["owned_by"], a["state"], a["source"]) == (
            "model",
            "mlx-actor-runtime",
            "loaded",
            "configured",
        )
        assert isinstance(a["created"], int) and a["context_length"] == 4096
        assert a["keep_alive"] == 300.0 and a["expires_at"] is not None
        assert b["keep_alive"] is None and b["expires_at"] is None
        assert (await client.get("/v1/models/a")).json()["state"] == "loaded"


async def test_unload_then_load_by_name() -> None:
    async with serving(sim_model("a"), sim_model("b")) as (client, server):
        unloaded = await client.post("/v1/models/unload", json={"model": "a"})
        assert unloaded.status_code == 200
        assert unloaded.json() == {"model": "a", "status": "unloaded", "epoch": 1}
        assert (await models(client))["a"]["state"] == "available"
        again = await client.post("/v1/models/unload", json={"model": "a"})
        assert (again.status_code, error_code(again)) == (404, "model_not_loaded")
        loaded = await client.post("/v1/models/load", json={"model": "a", "keep_alive": "5m"})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["keep_alive"] == 300.0 and loaded.json()["epoch"] == 3
        card = (await models(client))["a"]
        assert (card["state"], card["keep_alive"]) == ("loaded", 300.0)
        assert completed_text(await complete(client, "a")) == EXPECTED
        assert router_gauge(server, "models") == 2


async def test_load_refusals_are_typed() -> None:
    async with serving(sim_model("a")) as (client, _):
        loaded = await client.post("/v1/models/load", json={"model": "a"})
        assert (loaded.status_code, error_code(loaded)) == (409, "model_already_loaded")
        unknown = await client.post("/v1/models/load", json={"model": "nope"})
        assert (unknown.status_code, error_code(unknown)) == (404, "model_not_available")
        assert "GET /v1/models" in unknown.json()["error"]["message"]
        await client.post("/v1/models/unload", json={"model": "a"})
        for bad in ("soon", "1d", float("inf")):
            body = {"model": "a", "keep_alive": bad}
            response = await client.post(
                "/v1/models/load", content=msgspec.json.encode(body) if bad != float("inf")
                else b'{"model": "a", "keep_alive": 1e999}'
            )  # fmt: skip
            assert response.status_code == 400, (bad, response.text)
            assert response.json()["error"]["param"] == "keep_alive"
        missing = await client.post("/v1/models/load", json={})
        assert (missing.status_code, missing.json()["error"]["param"]) == (400, "model")


async def test_an_idle_model_unloads_after_its_keep_alive_and_comes_back_on_demand() -> None:
    async with serving(sim_model("m", keep_alive_s=0.0)) as (client, server):
        assert completed_text(await complete(client)) == EXPECTED
        await wait_until(server.runtime, lambda: router_gauge(server, "models_idle") == 1)
        assert (await models(client))["m"]["state"] == "idle"
        assert server.runtime.stats().actors["kv"].gauges["reserved"] == 0
        assert (await client.get("/health")).json()["models"] == {"m": "idle"}
        assert completed_text(await complete(client)) == EXPECTED  # loaded again
        counters = server.runtime.stats().actors["router"].counters
        assert counters["models_idle_unloaded"] >= 1


async def test_a_request_for_an_unloaded_model_loads_it_and_shows_it_loading() -> None:
    async with serving(sim_model("slow", load_s=2.0), sim_model()) as (client, server):
        assert (await client.post("/v1/models/unload", json={"model": "slow"})).status_code == 200
        async with anyio.create_task_group() as tg:
            responses: list[httpx.Response] = []

            async def request() -> None:
                responses.append(await complete(client, "slow"))

            tg.start_soon(request)
            await wait_until(server.runtime, lambda: router_gauge(server, "models_loading") == 1)
            assert (await models(client))["slow"]["state"] in ("preparing", "loading")
            busy = await client.post("/v1/models/load", json={"model": "slow"})
            assert (busy.status_code, error_code(busy)) == (409, "model_loading")
        assert completed_text(responses[0]) == EXPECTED
        assert (await models(client))["slow"]["state"] == "loaded"


async def test_without_auto_load_an_unloaded_model_is_404() -> None:
    async with serving(sim_model("a"), sim_model(), auto_load=False) as (client, _):
        await client.post("/v1/models/unload", json={"model": "a"})
        response = await complete(client, "a")
        assert (response.status_code, error_code(response)) == (404, "model_not_loaded")
        assert (await client.post("/v1/models/load", json={"model": "a"})).status_code == 200
        assert completed_text(await complete(client, "a")) == EXPECTED


async def test_unloading_an_idle_model_forgets_it_and_a_request_loads_it_again() -> None:
    async with serving(sim_model("m", keep_alive_s=0.0)) as (client, server):
        assert completed_text(await complete(client)) == EXPECTED
        await wait_until(server.runtime, lambda: router_gauge(server, "models_idle") == 1)
        response = await client.post("/v1/models/unload", json={"model": "m"})
        assert (response.status_code, error_code(response)) == (404, "model_not_loaded")
        assert (await models(client))["m"]["state"] == "available"
        assert completed_text(await complete(client)) == EXPECTED


async def test_a_model_with_replicas_is_listed_once_with_its_replicas() -> None:
    from runtime.cli.models import _ps_table

    async with serving(msgspec.structs.replace(sim_model("r"), replicas=2)) as (client, _):
        assert completed_text(await complete(client, "r")) == EXPECTED
        cards = await models(client)
        assert set(cards) == {"r"}  # one model, as an OpenAI client expects: no "available" twin
        card = cards["r"]
        assert (card["state"], card["source"], card["context_length"]) == (
            "loaded",
            "configured",
            4096,
        )
        assert [(r["id"], r["state"]) for r in card["replicas"]] == [
            ("r@0", "loaded"),
            ("r@1", "loaded"),
        ]
        replica = (await client.get("/v1/models/r@1")).json()
        assert replica["id"] == "r@1" and replica.get("replicas") is None
        table = _ps_table(list(cards.values())).splitlines()
        assert [line.split()[0] for line in table[1:]] == ["r@0", "r@1"]  # `mlxrt ps`: each
