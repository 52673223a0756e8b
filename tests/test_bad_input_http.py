"""The bad-input catalogue through the HTTP server (docs/reliability.md, "The catalogue").

Each case gets its status and the error body's stable ``code`` (and ``param`` when a field is at
fault) with a message saying what to change; no actor crashes; afterwards nothing is left behind
and the same server still answers a good request. The host API side is test_bad_input_api.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import ModelOption, sim_spec, wait_until

pytestmark = pytest.mark.anyio

CONTEXT = 64
COMPLETIONS, CHAT, PREWARM = "/v1/completions", "/v1/chat/completions", "/v1/prewarm"
Json = dict[str, Any]


def sim_model(name: str = "m", **options: ModelOption) -> ModelSpec:
    return sim_spec(name, chunk=8, context_length=CONTEXT, **options)


@contextlib.asynccontextmanager
async def serving(
    *models: ModelSpec, config: ServerConfig | None = None, **runtime: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    runtime_config = RuntimeConfig(**{"kv_budget_bytes": 64 << 20, **runtime})
    server = OpenAIServer(
        config or ServerConfig(models=models or (sim_model(),), runtime=runtime_config)
    )
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, server


def error_of(response: httpx.Response) -> Json:
    body: Json = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


async def assert_unharmed(client: httpx.AsyncClient, server: OpenAIServer) -> None:
    """Nothing leaked and the server still answers a good request."""
    good = await client.post(
        COMPLETIONS, json={"model": "m", "prompt": "ok", "max_tokens": 3, "temperature": 0}
    )
    assert good.status_code == 200, good.text
    assert good.json()["choices"][0]["text"] == bytes(greedy_continuation(list(b"ok"), 3)).decode()
    actors = server.runtime.stats().actors
    assert actors["router"].gauges["live_requests"] == 0
    assert all(s.gauges["sequences"] == 0 for a, s in actors.items() if a.startswith("engine"))
    assert actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]


@pytest.fixture
def no_crash(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.ERROR, logger="mlx_actor_runtime")
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def body(path: str, **fields: object) -> bytes:
    base: Json = {"model": "m", "max_tokens": 2}
    if path == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return json.dumps({**base, **fields}).encode()


def raw(path: str, field: str, literal: str) -> bytes:
    """A body with one field written as given: JSON has no NaN, and 1e999 reads as infinity."""
    return body(path)[:-1] + f', "{field}": {literal}}}'.encode()


# (case, path, body, status, code, param, a word the message must hold)
CASES: list[tuple[str, str, bytes, int, str, str | None, str]] = [
    ("empty prompt", COMPLETIONS, body(COMPLETIONS, prompt=""), 400, "invalid_request", "prompt",
     "empty"),
    ("empty prompt list", COMPLETIONS, body(COMPLETIONS, prompt=[]), 400, "invalid_request",
     "prompt", "empty"),
    ("empty messages", CHAT, body(CHAT, messages=[]), 400, "invalid_request", "messages",
     "at least one"),
    ("token id past the vocabulary", COMPLETIONS, body(COMPLETIONS, prompt=[1, 300]), 400,
     "invalid_request", "prompt", "vocabulary"),
    ("prompt over the context", COMPLETIONS, body(COMPLETIONS, prompt="x" * 100), 400,
     "context_length_exceeded", "prompt", "shorten"),
    ("prompt plus max_tokens over the context", COMPLETIONS,
     body(COMPLETIONS, prompt="x" * 40, max_tokens=40), 400, "context_length_exceeded", "prompt",
     "max_tokens"),
    ("chat over the context", CHAT, body(CHAT, messages=[{"role": "user", "content": "x" * 90}]),
     400, "context_length_exceeded", "messages", "shorten"),
    ("max_tokens 0", COMPLETIONS, body(COMPLETIONS, max_tokens=0), 400, "invalid_request",
     "max_tokens", "at least 1"),
    ("max_tokens negative", CHAT, body(CHAT, max_tokens=-3), 400, "invalid_request", "max_tokens",
     "at least 1"),
    ("max_tokens a float", COMPLETIONS, body(COMPLETIONS, max_tokens=2.5), 400, "invalid_request",
     "max_tokens", "int"),
    ("max_tokens text", CHAT, body(CHAT, max_tokens="8"), 400, "invalid_request", "max_tokens",
     "int"),
    ("max_tokens huge", COMPLETIONS, body(COMPLETIONS, max_tokens=10**9), 400,
     "context_length_exceeded", "prompt", "max_tokens (1000000000)"),
    ("max_tokens past int64", COMPLETIONS, raw(COMPLETIONS, "max_tokens", "1" + "0" * 30), 400,
     "invalid_request", "max_tokens", "max_tokens"),
    ("temperature NaN", COMPLETIONS, raw(COMPLETIONS, "temperature", "NaN"), 400,
     "invalid_request", None, "JSON"),
    ("temperature inf", COMPLETIONS, raw(COMPLETIONS, "temperature", "1e999"), 400,
     "invalid_request", "temperature", "out of range"),
    ("temperature negative", CHAT, body(CHAT, temperature=-0.5), 400, "invalid_request",
     "temperature", "0 (greedy) or more"),
    ("top_p 0", COMPLETIONS, body(COMPLETIONS, top_p=0), 400, "invalid_request", "top_p",
     "(0, 1]"),
    ("top_p above 1", CHAT, body(CHAT, top_p=1.5), 400, "invalid_request", "top_p", "(0, 1]"),
    ("top_p NaN", COMPLETIONS, raw(COMPLETIONS, "top_p", "NaN"), 400, "invalid_request", None,
     "JSON"),
    ("top_k negative", COMPLETIONS, body(COMPLETIONS, top_k=-2), 400, "invalid_request", "top_k",
     "0 (off)"),
    ("penalty inf", CHAT, raw(CHAT, "presence_penalty", "-1e999"), 400, "invalid_request",
     "presence_penalty", "out of range"),
    ("seed past int64", COMPLETIONS, body(COMPLETIONS, seed=2**63), 400, "invalid_request", "seed",
     "2**63"),
    ("seed past uint64", COMPLETIONS, body(COMPLETIONS, seed=2**64), 400, "invalid_request",
     "seed", "seed"),
    ("empty stop string", CHAT, body(CHAT, stop=[""]), 400, "invalid_request", "stop", "empty"),
    ("10,000 stop strings", COMPLETIONS, body(COMPLETIONS, stop=[f"s{i}" for i in range(10_000)]),
     400, "invalid_request", "stop", "at most 16"),
    ("malformed JSON", COMPLETIONS, b'{"model": "m", "prompt": "hi"', 400, "invalid_request", None,
     "not valid JSON"),
    ("malformed JSON (chat)", CHAT, b"{'model': 'm'}", 400, "invalid_request", None,
     "not valid JSON"),
    ("malformed JSON (prewarm)", PREWARM, b"\xff\xfe", 400, "invalid_request", None,
     "not valid JSON"),
    ("JSON that is not an object", COMPLETIONS, b"[1, 2]", 400, "invalid_request", None, "object"),
    ("deeply nested JSON", CHAT, raw(CHAT, "tools", "[" * 100_000 + "]" * 100_000), 400,
     "invalid_request", None, "nests too deeply"),
    ("unknown model", COMPLETIONS, body(COMPLETIONS, model="nope"), 404, "model_not_loaded",
     "model", "GET /v1/models"),
    ("unknown model (prewarm)", PREWARM, json.dumps({"model": "nope", "prompt": "x"}).encode(), 404,
     "model_not_loaded", "model", "GET /v1/models"),
    ("prewarm over the context", PREWARM, json.dumps({"model": "m", "prompt": "x" * 90}).encode(),
     400, "context_length_exceeded", "prompt", "shorten"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "content", "status", "code", "param", "says"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_bad_request_gets_its_status_and_code_and_the_server_goes_on(
    path: str,
    content: bytes,
    status: int,
    code: str,
    param: str | None,
    says: str,
    stream: bool,
    no_crash: None,
) -> None:
    if stream and path == PREWARM:
        pytest.skip("a prewarm does not stream")
    if stream and content.startswith(b"{") and content.endswith(b"}"):
        content = content[:-1] + b', "stream": true}'
    # Strict: a max_tokens past the room left is refused (by default it is lowered to it:
    # tests/test_http_max_tokens.py).
    async with serving(strict_max_tokens=True) as (client, server):
        response = await client.post(path, content=content)
        assert response.status_code == status, response.text
        error = error_of(response)
        assert (error["code"], error["param"]) == (code, param)
        assert says in error["message"]
        assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
        await assert_unharmed(client, server)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_a_body_labelled_other_than_json_is_415(content_type: str, no_crash: None) -> None:
    async with serving() as (client, server):
        response = await client.post(
            COMPLETIONS, content=body(COMPLETIONS), headers={"content-type": content_type}
        )
        assert response.status_code == 415
        error = error_of(response)
        assert error["code"] == "unsupported_media_type"
        assert "Content-Type: application/json" in error["message"]
        labelled = {"content-type": "application/json; charset=utf-8"}
        ok = await client.post(COMPLETIONS, content=body(COMPLETIONS), headers=labelled)
        assert ok.status_code == 200
        await assert_unharmed(client, server)


async def test_a_10_mb_body_is_413_under_the_default_limit(no_crash: None) -> None:
    ten_mb = body(COMPLETIONS, prompt="x" * 10_000_000)
    config = ServerConfig(models=(sim_model(),), runtime=RuntimeConfig(kv_budget_bytes=64 << 20))
    async with serving(config=config) as (client, server):
        declared = await client.post(COMPLETIONS, content=ten_mb)
        assert declared.status_code == 413

        async def undeclared() -> AsyncIterator[bytes]:  # chunked: no Content-Length to trust
            for start in range(0, len(ten_mb), 1 << 20):
                yield ten_mb[start : start + (1 << 20)]

        chunked = await client.post(COMPLETIONS, content=undeclared())
        assert chunked.status_code == 413
        for response in (declared, chunked):
            error = error_of(response)
            assert error["code"] == "request_too_large"
            assert str(8 << 20) in error["message"] and "shorter prompt" in error["message"]
        await assert_unharmed(client, server)


async def test_kv_refusals_say_what_to_change_and_nothing_of_other_clients(no_crash: None) -> None:
    # A context of 200 lets one request (110 tokens, 11,000 bytes) outgrow the whole budget.
    slow = sim_spec("m", chunk=8, context_length=200, bytes_per_token=100, decode_s_per_token=0.1)
    async with (
        serving(slow, kv_budget_bytes=10_000, reservation_timeout_s=0.05) as (client, server),
        anyio.create_task_group() as tg,
    ):
        too_big = await client.post(
            COMPLETIONS, content=body(COMPLETIONS, prompt="x" * 10, max_tokens=100)
        )
        assert too_big.status_code == 400 and error_of(too_big)["code"] == "kv_request_too_large"

        async def hog() -> None:  # 60 tokens: holds 6,000 of the 10,000 bytes
            await client.post(
                COMPLETIONS, content=body(COMPLETIONS, prompt="y" * 10, max_tokens=50)
            )

        tg.start_soon(hog)
        await wait_until(server.runtime, lambda: kv(server, "reserved") > 0)
        starved = await client.post(
            COMPLETIONS, content=body(COMPLETIONS, prompt="z" * 10, max_tokens=40)
        )
        assert starved.status_code == 503 and starved.headers["retry-after"] == "1"
        message = error_of(starved)["message"]
        assert message == (
            "the request waited 0.05s for 5000 bytes of KV cache and the server is still busy; "
            "retry later, or lower max_tokens."
        )
        tg.cancel_scope.cancel()
    # (the server is gone here: its lifespan ended with the task group)


def kv(server: OpenAIServer, gauge: str) -> int:
    return server.runtime.stats().actors["kv"].gauges[gauge]


async def test_a_budget_of_zero_refuses_every_request_with_400(no_crash: None) -> None:
    async with serving(kv_budget_bytes=0) as (client, server):
        response = await client.post(COMPLETIONS, content=body(COMPLETIONS))
        assert response.status_code == 400
        assert error_of(response)["code"] == "kv_request_too_large"
        assert "(0 bytes)" in error_of(response)["message"]
        assert server.runtime.stats().actors["router"].gauges["live_requests"] == 0


async def test_a_new_request_for_a_model_being_unloaded_is_404(no_crash: None) -> None:
    # Without auto-load: with it, the server would load the configured model again.
    async with (
        serving(sim_model("gone", decode_s_per_token=0.005), sim_model(), auto_load=False) as (
            client,
            server,
        ),
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(server.runtime.unload_model, "gone")
        await anyio.wait_all_tasks_blocked()
        response = await client.post(COMPLETIONS, content=body(COMPLETIONS, model="gone"))
        assert response.status_code == 404
        assert (error_of(response)["code"], error_of(response)["param"]) == (
            "model_not_loaded",
            "model",
        )
        await assert_unharmed(client, server)
