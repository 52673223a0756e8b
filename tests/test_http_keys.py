"""API keys, tenant-isolated caches and per-key limits on the in-process app (docs/http.md
"Security"); tests/test_serve_keys.py drives the same through a real ``mlxrt serve``."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from bench.soak.http_soak import serve_on_loopback
from runtime.errors import InvalidConfig
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.server.allowance import AllowanceStatistics
from runtime.server.auth import ApiKeys, presented_key, read_key_file
from runtime.testing.harness import sim_spec

pytestmark = pytest.mark.anyio

ALICE, BOB = "alice-key-0123456789", "bob-key-9876543210"
PROMPT = "the same long prompt, sent by two tenants " * 3
Json = dict[str, Any]


def sim_model(**options: Any) -> ModelSpec:
    return sim_spec("m", chunk=8, **options)


@contextlib.asynccontextmanager
async def serving(
    model: ModelSpec | None = None, **config: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    """The app with keys for Alice and Bob (unless ``config`` says otherwise), served."""
    settings: dict[str, Any] = {"api_keys": ApiKeys([ALICE, BOB]), **config}
    runtime = RuntimeConfig(kv_budget_bytes=64 << 20)
    server = OpenAIServer(ServerConfig(models=(model or sim_model(),), runtime=runtime, **settings))
    # uvicorn on loopback: ASGITransport would hold a stream's response until the app ends.
    async with serve_on_loopback(server, start_within_s=10, client_timeout=10) as client:
        yield client, server


def as_(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


async def complete(client: httpx.AsyncClient, key: str, **body: object) -> httpx.Response:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **body}
    return await client.post("/v1/completions", json=body, headers=as_(key))


def cached(response: httpx.Response) -> tuple[int, int, int]:
    """(prompt tokens, cached prompt tokens, tokens prefilled by this request)."""
    assert response.status_code == 200, response.text
    body = response.json()
    usage, timings = body["usage"], body["timings"]
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    return usage["prompt_tokens"], timings["cache_n"], timings["prompt_n"]


# --------------------------------------------------------------------------- who may use it


REFUSED_HEADERS = {
    "no key": {},
    "a wrong key": {"authorization": "Bearer not-a-key"},
    "a key's prefix": {"authorization": f"Bearer {ALICE[:-1]}"},
    "another scheme": {"authorization": f"Basic {ALICE}"},
    "a bare scheme": {"authorization": "Bearer"},
    "a wrong x-api-key": {"x-api-key": "not-a-key"},
}


async def test_every_refusal_is_the_same_401_that_names_no_key() -> None:
    async with serving() as (client, _):
        answers = set()
        for headers in REFUSED_HEADERS.values():
            for method, path in (
                ("POST", "/v1/completions"),
                ("GET", "/v1/models"),
                ("POST", "/v1/models/load"),
                ("GET", "/no/such/path"),  # no route is revealed either
                ("GET", "/metrics"),
            ):
                response = await client.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (headers, path)
                assert response.headers["www-authenticate"] == "Bearer"
                answers.add(response.content)
        [body] = answers  # one body for all: nothing says which key was near or what exists
        error = httpx.Response(401, content=body).json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "Authorization: Bearer" in error["message"]
        assert ALICE not in body.decode() and BOB not in body.decode()


async def test_a_valid_key_passes_as_a_bearer_or_as_x_api_key() -> None:
    async with serving() as (client, _):
        assert (await client.get("/v1/models", headers=as_(ALICE))).status_code == 200
        lower = {"authorization": f"bearer {BOB}"}  # the scheme is case-insensitive (RFC 7235)
        assert (await client.get("/v1/models", headers=lower)).status_code == 200
        assert (await client.get("/v1/models", headers={"x-api-key": BOB})).status_code == 200
        assert (await complete(client, ALICE)).status_code == 200


async def test_health_stays_open_and_metrics_take_any_key_by_default() -> None:
    async with serving() as (client, _):
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 401
        assert (await client.get("/metrics", headers=as_(BOB))).status_code == 200
        preflight = await client.options("/v1/completions")  # a browser's, never with a key
        assert preflight.status_code != 401


async def test_metrics_can_be_public_or_need_their_own_keys() -> None:
    async with serving(public_metrics=True) as (client, _):
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401
    scraper = "scraper-key-5555"
    async with serving(metrics_keys=ApiKeys([scraper])) as (client, _):
        assert (await client.get("/metrics", headers=as_(scraper))).status_code == 200
        assert (await client.get("/metrics", headers=as_(ALICE))).status_code == 401
        assert (await client.get("/v1/models", headers=as_(scraper))).status_code == 401


async def test_a_mounted_server_keeps_health_open_and_the_rest_behind_its_keys() -> None:
    server = OpenAIServer(ServerConfig(models=(sim_model(),), api_keys=ApiKeys([ALICE])))
    host = Starlette(routes=[Mount("/openai", app=server.app)])
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=host)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.get("/openai/health")).status_code == 200
            assert (await client.get("/openai/metrics")).status_code == 401
            assert (await client.get("/openai/v1/models")).status_code == 401
            models = await client.get("/openai/v1/models", headers=as_(ALICE))
            assert models.status_code == 200


async def test_a_server_without_keys_answers_everyone() -> None:
    async with serving(api_keys=None) as (client, _):
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await complete(client, "anything")).status_code == 200


def test_keys_are_held_as_digests_and_bad_keys_are_refused_by_position(tmp_path: Any) -> None:
    keys = ApiKeys([ALICE, BOB, ALICE])
    assert len(keys) == 2 and ALICE not in repr(keys)
    alice = keys.tenant_of(ALICE)
    assert alice is not None and alice == keys.tenant_of(ALICE) != keys.tenant_of(BOB)
    assert ALICE not in alice.id and alice.id not in hashlib.sha256(ALICE.encode()).hexdigest()
    assert keys.tenant_of(None) is None and keys.tenant_of("") is None
    for bad in ([], [""], ["has space"], ["tab\there"], ["ünïcode"]):
        with pytest.raises(InvalidConfig) as refused:
            ApiKeys(bad)
        assert all(key not in refused.value.message for key in bad if key)
    path = tmp_path / "keys"
    path.write_text(f"# tenants\n\n  {ALICE}  \n{BOB}\n")
    assert read_key_file(path) == [ALICE, BOB]
    path.write_text(f"{ALICE}\nnot a key\n")
    with pytest.raises(InvalidConfig, match="line 2 of the API key file"):
        read_key_file(path)
    path.write_text("# only a comment\n")
    with pytest.raises(InvalidConfig, match="holds no keys"):
        read_key_file(path)
    with pytest.raises(InvalidConfig, match="cannot read the API key file"):
        read_key_file(tmp_path / "missing")


def test_the_presented_key_is_the_bearer_token_else_x_api_key() -> None:
    assert presented_key([(b"authorization", b"Bearer  abc ")]) == "abc"
    assert presented_key([(b"x-api-key", b"xyz")]) == "xyz"
    assert presented_key([(b"x-api-key", b"xyz"), (b"authorization", b"Bearer abc")]) == "abc"
    assert presented_key([(b"authorization", b"Basic abc")]) is None
    assert presented_key([]) is None


# --------------------------------------------------------------------------- tenants' caches


async def test_two_keys_never_share_a_cached_prompt_and_one_key_does() -> None:
    async with serving() as (client, _):
        prompt_tokens, hit, prefilled = cached(await complete(client, ALICE))
        assert hit == 0 and prefilled == prompt_tokens
        # Bob's identical prompt prefills it all: nothing of Alice's serves or times it.
        assert cached(await complete(client, BOB)) == (prompt_tokens, 0, prompt_tokens)
        # Each key reuses its own.
        _, alice_hit, _ = cached(await complete(client, ALICE))
        _, bob_hit, _ = cached(await complete(client, BOB))
        assert alice_hit > 0 and bob_hit > 0


async def test_a_cache_salt_still_separates_users_behind_one_key() -> None:
    async with serving() as (client, _):
        first = cached(await complete(client, ALICE, cache_salt="user-1"))
        assert first[1] == 0
        assert cached(await complete(client, ALICE, cache_salt="user-2"))[1] == 0
        assert cached(await complete(client, ALICE))[1] == 0  # no salt: the key's own default
        assert cached(await complete(client, ALICE, cache_salt="user-1"))[1] > 0
        # Bob with Alice's salt is still Bob: a salt is within a key, never across keys.
        assert cached(await complete(client, BOB, cache_salt="user-1"))[1] == 0


async def test_a_prewarm_warms_only_its_own_keys_cache() -> None:
    async with serving() as (client, _):
        body = {"model": "m", "prompt": PROMPT}
        warmed = await client.post("/v1/prewarm", json=body, headers=as_(ALICE))
        assert warmed.json()["status"] == "prewarmed"
        probe = {**body, "cache_salt": "probe"}  # Bob's own probe warms only Bob's "probe"
        assert (await client.post("/v1/prewarm", json=probe, headers=as_(BOB))).json() == {
            "object": "prewarm",
            "model": "m",
            "status": "prewarmed",
            "prompt_tokens": len(PROMPT),
            "cached_tokens": 0,  # Bob learns nothing of Alice's prewarm
        }
        assert cached(await complete(client, BOB))[1] == 0
        assert cached(await complete(client, ALICE))[1] > 0


async def test_one_key_cannot_supersede_another_keys_session() -> None:
    model = sim_model(decode_s_per_token=0.002)
    async with serving(model) as (client, _):
        body = {"session": "editor", "max_tokens": 64, "stream": True}
        async with client.stream(
            "POST",
            "/v1/completions",
            json={"model": "m", "prompt": "alice types", "temperature": 0, **body},
            headers=as_(ALICE),
        ) as alice:
            lines = alice.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # Alice's request runs
            # Bob names the same session and asks to supersede it: only his own could be.
            bob = await complete(client, BOB, session="editor", supersede=True)
            assert bob.status_code == 200
            rest = [line async for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest)


async def test_no_metric_or_log_names_a_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with serving(public_metrics=True, max_concurrent_per_key=1) as (client, _):
        await complete(client, ALICE, cache_salt="user-1")
        await complete(client, BOB)
        await client.get("/v1/models", headers=as_("a-wrong-key"))
        exposition = (await client.get("/metrics")).text
        assert "namespace" not in exposition and "key-" not in exposition
        assert ALICE not in exposition and "user-1" not in exposition
    logged = caplog.text
    assert logged and all(key not in logged for key in (ALICE, BOB, "a-wrong-key"))


# --------------------------------------------------------------------------- per-key limits


async def every_ticket_given_back(server: OpenAIServer) -> None:
    """Wait (bounded) until no key has a request running or waiting: a ticket is given back once
    the app has returned, which may be after its client read the answer."""
    assert server.allowances is not None
    with anyio.fail_after(10):
        while server.allowances.statistics():
            await anyio.lowlevel.checkpoint()


async def test_a_key_over_its_limits_is_429_and_other_keys_are_not() -> None:
    model = sim_model(decode_s_per_token=0.002)
    limits = {"max_concurrent_per_key": 1, "max_queued_per_key": 1}
    async with serving(model, **limits) as (client, server):
        assert server.allowances is not None
        long = {"model": "m", "prompt": "go", "max_tokens": 200, "temperature": 0, "stream": True}
        async with client.stream(
            "POST", "/v1/completions", json=long, headers=as_(ALICE)
        ) as running:
            async for line in running.aiter_lines():
                if line.startswith("data: "):
                    break
            queued: list[httpx.Response] = []

            async def wait_in_queue() -> None:
                queued.append(await complete(client, ALICE))

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_in_queue)
                with anyio.fail_after(10):
                    while list(server.allowances.statistics().values()) != [
                        AllowanceStatistics(running=1, waiting=1)
                    ]:
                        await anyio.lowlevel.checkpoint()  # the server's own state, polled
                refused = await complete(client, ALICE)
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "1"
                error = refused.json()["error"]
                assert error["code"] == "rate_limit_exceeded"
                assert "1 requests running and 1 waiting" in error["message"]
                assert (await complete(client, BOB)).status_code == 200  # Bob has his own
                await running.aclose()  # Alice's stream ends: her queued request runs
        assert queued[0].status_code == 200
        await every_ticket_given_back(server)


async def test_without_keys_the_limits_hold_for_all_clients_together() -> None:
    model = sim_model(decode_s_per_token=0.002)
    async with serving(model, api_keys=None, max_concurrent_per_key=1) as (client, server):
        long = {"model": "m", "prompt": "go", "max_tokens": 200, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=long) as running:
            async for line in running.aiter_lines():
                if line.startswith("data: "):
                    break
            refused = await complete(client, "ignored")
            assert refused.status_code == 429
            assert "this server's limit" in refused.json()["error"]["message"]
            assert (await client.get("/v1/models")).status_code == 200  # only POSTs count
        await every_ticket_given_back(server)  # the stream's, as its client closed it


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"max_concurrent_per_key": 0}, "max_concurrent_per_key must be at least 1"),
        ({"max_concurrent_per_key": 2, "max_queued_per_key": -1}, "max_queued_per_key"),
        ({"max_queued_per_key": 3}, "set both"),
        ({"api_keys": (ALICE,)}, "api_keys must be runtime.server.ApiKeys"),
    ],
)
def test_limits_out_of_range_are_refused_naming_them(config: Json, words: str) -> None:
    with pytest.raises(InvalidConfig, match=words):
        OpenAIServer(ServerConfig(models=(sim_model(),), **config))


async def test_a_request_queued_behind_its_keys_limit_gets_a_503_when_the_server_stops() -> None:
    """A shutdown answers the requests waiting for a slot at once (503 server_shutting_down),
    not once the slot's holder ends (here a prewarm, which the shutdown does not end), nor by
    dropping them with the connection."""
    model = sim_model(prefill_s_per_token=0.001)
    limits = {"max_concurrent_per_key": 1, "max_queued_per_key": 1}
    async with serving(model, **limits) as (client, server):
        assert server.allowances is not None
        warmed: list[httpx.Response] = []
        queued: list[httpx.Response] = []

        async def hold_the_slot() -> None:  # ~3 s of prefill (3,000 bytes)
            body = {"model": "m", "prompt": "warm " * 600}
            warmed.append(await client.post("/v1/prewarm", json=body, headers=as_(ALICE)))

        async def wait_in_queue() -> None:
            queued.append(await complete(client, ALICE))

        async def wait_for(running: int, waiting: int) -> None:
            with anyio.fail_after(10):
                while list(server.allowances.statistics().values()) != [
                    AllowanceStatistics(running=running, waiting=waiting)
                ]:
                    assert not warmed, warmed[0].text
                    await anyio.lowlevel.checkpoint()  # the server's own state, polled

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold_the_slot)
            await wait_for(1, 0)
            tg.start_soon(wait_in_queue)
            await wait_for(1, 1)
            await server.stop_generations(0)
            with anyio.fail_after(10):
                while not queued:
                    await anyio.lowlevel.checkpoint()
            assert not warmed, "the queued request was answered only once the slot came free"
            tg.cancel_scope.cancel()
        assert queued[0].status_code == 503
        assert queued[0].json()["error"]["code"] == "server_shutting_down"
