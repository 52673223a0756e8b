"""``max_tokens`` past the room the prompt leaves: lowered to that room (the reply ends "length"
there and ``usage``/``timings`` say so), or with ``strict_max_tokens`` refused naming the value
sent; the server's ``default_max_tokens`` (``mlxrt serve --max-tokens``); the same for the host
API. The simulated model's context is 64 tokens (one token per byte)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.cli import main
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, Failed, Finished, FinishReason
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import sim_spec
from tests.test_serve_process import mlxrt_serve

pytestmark = pytest.mark.anyio

CONTEXT = 64
PROMPT = "hello world"  # 11 tokens: 53 left
ROOM = CONTEXT - len(PROMPT)


@contextlib.asynccontextmanager
async def serving(strict: bool = False, **server: Any) -> AsyncIterator[httpx.AsyncClient]:
    runtime = RuntimeConfig(kv_budget_bytes=64 << 20, strict_max_tokens=strict)
    config = ServerConfig(
        models=(sim_spec("m", chunk=8, context_length=CONTEXT),), runtime=runtime, **server
    )
    app = OpenAIServer(config).app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client


async def complete(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await client.post(
        "/v1/completions", json={"model": "m", "prompt": PROMPT, "temperature": 0, **body}
    )


@pytest.mark.parametrize("asked", [ROOM + 1, 8192, 32768, 1_000_000_000])
async def test_a_max_tokens_past_the_room_left_is_lowered_to_it(asked: int) -> None:
    async with serving() as client:
        response = await complete(client, max_tokens=asked)
        assert response.status_code == 200, response.text
        body = response.json()
        [choice] = body["choices"]
        assert choice["finish_reason"] == "length"
        assert choice["text"] == bytes(greedy_continuation(list(PROMPT.encode()), ROOM)).decode()
        assert body["usage"]["completion_tokens"] == ROOM
        assert body["usage"]["max_tokens_clamped_to"] == ROOM
        assert body["timings"]["max_tokens_clamped_to"] == ROOM


async def test_a_max_tokens_that_fits_says_nothing_of_a_clamp() -> None:
    async with serving() as client:
        body = (await complete(client, max_tokens=ROOM)).json()
        assert body["usage"]["completion_tokens"] == ROOM
        assert "max_tokens_clamped_to" not in body["usage"]
        assert "max_tokens_clamped_to" not in body["timings"]


async def test_a_streamed_chat_reports_the_clamp_in_its_finish_chunk_and_usage() -> None:
    async with serving() as client:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 100_000,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert response.status_code == 200, response.text
        events = [
            json.loads(block.removeprefix("data: "))
            for block in response.text.split("\n\n")
            if block and block != "data: [DONE]"
        ]
        *_, finish, usage = events
        assert finish["choices"][0]["finish_reason"] == "length"
        clamped = finish["timings"]["max_tokens_clamped_to"]
        assert usage["usage"]["max_tokens_clamped_to"] == clamped
        assert usage["usage"]["completion_tokens"] == clamped
        assert usage["usage"]["prompt_tokens"] + clamped == CONTEXT


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_strict_refuses_naming_the_value_sent(path: str) -> None:
    async with serving(strict=True) as client:
        body: dict[str, Any] = {"model": "m", "max_tokens": 1_000_000_000}
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = PROMPT
        response = await client.post(path, json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "max_tokens (1000000000)" in error["message"]
        assert f"context of {CONTEXT} tokens" in error["message"]


async def test_a_prompt_that_fills_the_context_is_refused_even_when_clamping() -> None:
    async with serving() as client:
        for prompt in ("x" * CONTEXT, "x" * (CONTEXT + 5)):
            response = await complete(client, prompt=prompt, max_tokens=4)
            assert response.status_code == 400
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
            assert "shorten the prompt" in error["message"]


async def test_the_server_default_max_tokens_applies_to_requests_that_send_none() -> None:
    async with serving(default_max_tokens=5) as client:
        assert (await complete(client)).json()["usage"]["completion_tokens"] == 5
        assert (await complete(client, max_tokens=None)).json()["usage"]["completion_tokens"] == 5
        assert (await complete(client, max_tokens=7)).json()["usage"]["completion_tokens"] == 7
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0},
        )
        assert chat.json()["usage"]["completion_tokens"] == 5
    async with serving(default_max_tokens=1000) as client:  # lowered to the room as any limit
        usage = (await complete(client)).json()["usage"]
        assert usage["completion_tokens"] == ROOM and usage["max_tokens_clamped_to"] == ROOM


async def test_the_host_api_clamps_by_default_and_refuses_when_strict() -> None:
    spec = sim_spec("m", chunk=8, context_length=CONTEXT)
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        await rt.load_model(spec)
        result = await rt.complete("m", PROMPT, max_tokens=10**9)
        assert isinstance(result.terminal, Finished)
        assert result.terminal.reason is FinishReason.LENGTH
        assert result.terminal.usage.max_tokens_clamped_to == ROOM
        chat = await rt.complete("m", messages=[ChatMessage("user", "hi")], max_tokens=10**9)
        assert isinstance(chat.terminal, Finished)
        assert chat.terminal.usage.max_tokens_clamped_to is not None
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20, strict_max_tokens=True)) as rt:
        await rt.load_model(spec)
        for kwargs in ({"prompt": PROMPT}, {"messages": [ChatMessage("user", "hi")]}):
            result = await rt.complete("m", max_tokens=10**9, **kwargs)  # type: ignore[arg-type]
            assert isinstance(result.terminal, Failed)
            assert result.terminal.code == "context_length_exceeded"
            assert "max_tokens (1000000000)" in result.terminal.message


def test_serve_refuses_a_max_tokens_below_1(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--backend", "simulated", "--model", "m", "--max-tokens", "0"])
    assert exited.value.code == 2
    assert "--max-tokens must be at least 1 (got 0)" in capsys.readouterr().err


def test_mlxrt_serve_wires_max_tokens_strict_and_allowed_origins() -> None:
    """The flags reach a real ``mlxrt serve``: --max-tokens for a request that sends none,
    --strict-max-tokens refusing a limit past the context, --allowed-origins answering CORS."""
    flags = ("--backend", "simulated", "--model", "m", "--max-tokens", "5", "--strict-max-tokens")
    origin = "http://localhost:3000"
    with mlxrt_serve(*flags, "--allowed-origins", origin) as url:
        body = {"model": "m", "prompt": "hello", "temperature": 0}
        default = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
        assert default.json()["usage"]["completion_tokens"] == 5
        huge = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 10**9}, timeout=60.0)
        assert huge.status_code == 400
        assert "max_tokens (1000000000)" in huge.json()["error"]["message"]
        preflight = httpx.options(
            f"{url}/v1/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
            timeout=60.0,
        )
        assert preflight.headers["access-control-allow-origin"] == origin
