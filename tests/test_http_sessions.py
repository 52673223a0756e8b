"""HTTP requests without a ``session``: one client's request never cuts another's short.

The server cannot tell its sessionless clients apart, so it sends their requests as anonymous
(docs/http.md, "Sessions, prewarm and reuse"): they still adopt an in-flight prewarm they extend,
and identical prewarms still compute once, but nothing they send supersedes another's work.
Simulated backend through httpx's ASGI transport, as tests/test_http_server.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from anyio.abc import TaskGroup

from runtime.backends.simulated import greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.host.streams import TERMINALS
from runtime.kernel.core import engine_address
from runtime.messages import ModelSpec, TokensEmitted
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import ModelOption, sim_spec, wait_until

pytestmark = pytest.mark.anyio

Json = dict[str, Any]


def sim_model(**options: ModelOption) -> ModelSpec:
    return sim_spec("m", chunk=8, **options)


@contextlib.asynccontextmanager
async def serving(model: ModelSpec) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    """A running server (its lifespan entered) and a client on its ASGI app."""
    config = RuntimeConfig(kv_budget_bytes=64 << 20)
    server = OpenAIServer(ServerConfig(models=(model,), runtime=config))
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, server


def counter(server: OpenAIServer, name: str) -> int:
    # The lifespan loaded the one model on a fresh runtime: its first epoch.
    return server.runtime.stats().actors[engine_address("m", 1)].counters.get(name, 0)


class Prewarms:
    """Prewarms posted in the background; their answers, by name, once they end."""

    def __init__(self, client: httpx.AsyncClient, tg: TaskGroup) -> None:
        self._client, self._tg = client, tg
        self.answers: dict[str, Json] = {}

    def post(self, name: str, **body: object) -> None:
        self._tg.start_soon(functools.partial(self._post, name, body))

    async def _post(self, name: str, body: dict[str, object]) -> None:
        response = await self._client.post("/v1/prewarm", json={"model": "m", **body})
        assert response.status_code == 200, response.text
        self.answers[name] = response.json()


async def complete(client: httpx.AsyncClient, prompt: str, **body: object) -> Json:
    response = await client.post(
        "/v1/completions",
        json={"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0, **body},
    )
    assert response.status_code == 200, response.text
    answer: Json = response.json()
    return answer


async def test_a_sessionless_request_never_supersedes_another_clients_prewarm() -> None:
    async with serving(sim_model(prefill_s_per_token=0.002)) as (client, server):
        async with anyio.create_task_group() as tg:
            warm = Prewarms(client, tg)
            warm.post("first", prompt="z" * 300)
            await wait_until(server.runtime, lambda: counter(server, "prefilled_tokens") > 0)
            warm.post("second", prompt="q" * 40)  # another client's focus
            await complete(client, "hello")  # and a third client's request
        assert warm.answers["first"]["status"] == "prewarmed"
        assert warm.answers["second"]["status"] == "prewarmed"
        assert counter(server, "prewarms_superseded") == 0


async def test_a_sessionless_generate_adopts_the_prewarm_it_extends() -> None:
    prompt = "w" * 300
    async with serving(sim_model(prefill_s_per_token=0.002)) as (client, server):
        async with anyio.create_task_group() as tg:
            warm = Prewarms(client, tg)
            warm.post("warm", prompt=prompt)
            await wait_until(server.runtime, lambda: counter(server, "prefilled_tokens") > 0)
            answer = await complete(client, prompt + "?")
        assert warm.answers["warm"]["status"] == "adopted"
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        reply = bytes(greedy_continuation(list((prompt + "?").encode()), 2)).decode()
        assert answer["choices"][0]["text"] == reply
        assert counter(server, "prefilled_tokens") == len(prompt) + 1  # the prompt, once


async def test_with_a_session_a_new_prewarm_supersedes_the_older_one() -> None:
    async with serving(sim_model(prefill_s_per_token=0.002)) as (client, server):
        async with anyio.create_task_group() as tg:
            warm = Prewarms(client, tg)
            warm.post("first", prompt="z" * 300, session="editor")
            await wait_until(server.runtime, lambda: counter(server, "prefilled_tokens") > 0)
            warm.post("second", prompt="q" * 40, session="editor")
        assert warm.answers["first"]["status"] == "superseded"
        assert warm.answers["second"]["status"] == "prewarmed"


async def test_identical_sessionless_prewarms_prefill_once() -> None:
    prompt = "p" * 100
    # One sequence past the admission gate at a time: the prewarms wait while a stream decodes.
    model = sim_model(max_concurrent=1, decode_s_per_token=0.002)
    async with serving(model) as (client, server):
        async with server.runtime.generate("m", "busy", max_tokens=4000) as busy:
            async for event in busy:
                assert not isinstance(event, TERMINALS), event
                if isinstance(event, TokensEmitted):
                    break  # decoding: the gate is full
            before = counter(server, "prefilled_tokens")
            async with anyio.create_task_group() as tg:
                warm = Prewarms(client, tg)
                for name in "abcd":
                    warm.post(name, prompt=prompt)
                await wait_until(
                    server.runtime, lambda: counter(server, "prewarms_deduplicated") == 3
                )
                await server.runtime.cancel(busy.request_id)  # the gate opens
        assert [warm.answers[name]["status"] for name in "abcd"] == ["prewarmed"] * 4
        cached = sorted(warm.answers[name]["cached_tokens"] for name in "abcd")
        assert cached == [0, 99, 99, 99]  # the followers computed nothing of it
        assert counter(server, "prefilled_tokens") - before == len(prompt) - 1


async def test_supersede_aborts_the_sessions_older_generate_and_no_one_elses() -> None:
    async with (
        serving(sim_model(decode_s_per_token=0.02)) as (client, server),
        anyio.create_task_group() as tg,
    ):
        answers: dict[str, httpx.Response] = {}

        async def post(name: str, **body: object) -> None:
            answers[name] = await client.post(
                "/v1/completions",
                json={"model": "m", "prompt": name, "max_tokens": 200, "temperature": 0, **body},
            )

        tg.start_soon(functools.partial(post, "mine", session="editor"))
        tg.start_soon(functools.partial(post, "theirs", session="other", max_tokens=5))
        await wait_until(
            server.runtime,
            lambda: counter(server, "decoded_tokens") > 0,
            what="the first completions decode",
        )
        await complete(client, "mine, one key later", session="editor", supersede=True)
    cut = answers["mine"]
    assert cut.status_code == 409, cut.text
    assert cut.json()["error"]["code"] == "request_cancelled"
    assert "superseded" in cut.json()["error"]["message"]
    assert answers["theirs"].status_code == 200  # another session's request runs on


async def test_supersede_without_a_session_is_refused_naming_it() -> None:
    async with serving(sim_model()) as (client, _):
        response = await client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x", "max_tokens": 2, "supersede": True},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "supersede" and "session" in error["message"]
