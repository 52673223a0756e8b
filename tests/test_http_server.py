"""The OpenAI-compatible HTTP server on the simulated backend, through httpx's ASGI transport."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
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

CHUNK = 8
Json = dict[str, Any]


def sim_model(name: str = "m", **options: ModelOption) -> ModelSpec:
    return sim_spec(name, chunk=CHUNK, **options)


@contextlib.asynccontextmanager
async def serving(
    *models: ModelSpec, **runtime: object
) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    """A running server (its lifespan entered) and a client on its ASGI app."""
    config = RuntimeConfig(**{"kv_budget_bytes": 64 << 20, **runtime})  # type: ignore[arg-type]
    server = OpenAIServer(ServerConfig(models=models or (sim_model(),), runtime=config))
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, server


def kv_reserved(server: OpenAIServer) -> int:
    return server.runtime.stats().actors["kv"].gauges["reserved"]


def expected(prompt: str, n: int) -> str:
    return bytes(greedy_continuation(list(prompt.encode()), n)).decode()


def sse_data(response: httpx.Response) -> list[Json | str]:
    """Each event's data, decoded; the closing ``[DONE]`` stays a string."""
    assert response.headers["content-type"].startswith("text/event-stream")
    events: list[Json | str] = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: ")
            data = block.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def error_of(response: httpx.Response) -> Json:
    body: Json = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


async def complete(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": "m", "temperature": 0, **body})


async def chat(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={"model": "m", "temperature": 0, **body})


# --------------------------------------------------------------------------- completions


async def test_completion_matches_the_greedy_reference_with_exact_usage() -> None:
    async with serving() as (client, _):
        response = await complete(client, prompt="hello world", max_tokens=6)
        assert response.status_code == 200
        body = response.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert response.headers["x-request-id"] == body["id"]
        [choice] = body["choices"]
        assert choice["text"] == expected("hello world", 6)
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
        assert body["usage"] == {
            "prompt_tokens": 11,
            "completion_tokens": 6,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        # Prefix reuse across HTTP requests: all but the last prompt token come from the cache.
        again = await complete(client, prompt="hello world", max_tokens=6)
        assert again.json()["choices"][0]["text"] == choice["text"]
        assert again.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 10}


async def test_a_prompt_of_token_ids_is_the_same_prompt() -> None:
    async with serving() as (client, _):
        as_ids = await complete(client, prompt=list(b"hi there"), max_tokens=5)
        as_one_list = await complete(client, prompt=[list(b"hi there")], max_tokens=5)
        assert as_ids.json()["choices"][0]["text"] == expected("hi there", 5)
        assert as_one_list.json()["choices"][0]["text"] == expected("hi there", 5)


async def test_completions_default_to_16_tokens_and_null_means_the_rest_of_the_context() -> None:
    async with serving(sim_model(context_length=40)) as (client, _):
        default = await complete(client, prompt="0123456789")
        assert default.json()["usage"]["completion_tokens"] == 16
        rest = await complete(client, prompt="0123456789", max_tokens=None)
        assert rest.json()["usage"]["completion_tokens"] == 30


async def test_streamed_completion_equals_the_whole_one_in_fewer_chunks() -> None:
    async with serving() as (client, _):
        whole = await complete(client, prompt="a reply", max_tokens=200)
        streamed = await complete(
            client,
            prompt="a reply",
            max_tokens=200,
            stream=True,
            stream_options={"include_usage": True},
        )
        assert streamed.status_code == 200
        *chunks, finish, usage, done = sse_data(streamed)
        assert done == "[DONE]"
        texts = [c["choices"][0]["text"] for c in chunks]  # type: ignore[index]
        assert "".join(texts) == whole.json()["choices"][0]["text"]
        assert 1 < len(texts) < 200  # coalesced by the runtime's coalescer, not one per token
        assert all(c["usage"] is None for c in [*chunks, finish])  # type: ignore[index]
        assert finish["choices"] == [  # type: ignore[index]
            {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}
        ]
        assert usage["choices"] == []  # type: ignore[index]
        assert usage["usage"] == {  # type: ignore[index]
            **whole.json()["usage"],
            "prompt_tokens_details": {"cached_tokens": 6},  # the first request's prompt
        }


async def test_completion_logprobs_come_one_chunk_per_token() -> None:
    async with serving() as (client, _):
        response = await complete(client, prompt="probe", max_tokens=5, logprobs=2, stream=True)
        *chunks, finish, done = sse_data(response)
        assert len(chunks) == 5 and done == "[DONE]"
        assert finish["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
        offset = 0
        for chunk in chunks:
            [choice] = chunk["choices"]  # type: ignore[index]
            logprobs = choice["logprobs"]
            assert logprobs["tokens"] == [choice["text"]]
            assert logprobs["text_offset"] == [offset]
            [top] = logprobs["top_logprobs"]
            assert len(top) == 2 and top[choice["text"]] == logprobs["token_logprobs"][0] < 0
            offset += len(choice["text"])
        whole = await complete(client, prompt="probe", max_tokens=5, logprobs=0)
        logprobs = whole.json()["choices"][0]["logprobs"]
        assert "".join(logprobs["tokens"]) == expected("probe", 5)
        assert logprobs["top_logprobs"] == [{} for _ in range(5)]


async def test_stop_strings_end_the_text_and_finish_with_stop() -> None:
    async with serving() as (client, _):
        full = expected("stop here", 12)
        stop = full[5:8]
        for given in (stop, [stop, "never"]):
            response = await complete(client, prompt="stop here", max_tokens=12, stop=given)
            [choice] = response.json()["choices"]
            assert choice["text"] == full[: full.index(stop)]
            assert choice["finish_reason"] == "stop"
            usage = response.json()["usage"]
            assert usage["completion_tokens"] == full.index(stop) + len(stop)


async def test_sampling_fields_and_extra_samplers_reach_the_runtime() -> None:
    async with serving() as (client, _):
        biased = await complete(client, prompt="bias me", max_tokens=6, logit_bias={"81": 50})
        assert biased.json()["choices"][0]["text"] == "QQQQQQ"
        plain = await complete(client, prompt="x", max_tokens=30)
        penalised = await complete(client, prompt="x", max_tokens=30, repetition_penalty=50.0)
        assert penalised.json()["choices"][0]["text"] != plain.json()["choices"][0]["text"]

        async def sampled(seed: int) -> str:
            response = await complete(
                client, prompt="seeded", max_tokens=12, temperature=1.0, seed=seed, top_k=-1
            )
            return response.json()["choices"][0]["text"]  # type: ignore[no-any-return]

        assert await sampled(7) == await sampled(7) != await sampled(8)
        # Omitted temperature is OpenAI's 1.0, not greedy.
        unseeded = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "seeded", "seed": 7, "max_tokens": 12}
        )
        assert unseeded.json()["choices"][0]["text"] == await sampled(7)


async def test_a_server_default_temperature_fills_in_where_a_request_sends_none() -> None:
    # mlxrt serve's --temp 0 (mlx_lm.server's default): an omitted temperature is greedy.
    config = ServerConfig(
        models=(sim_model(),),
        runtime=RuntimeConfig(kv_budget_bytes=64 << 20),
        default_temperature=0.0,
    )
    server = OpenAIServer(config)
    body = {"model": "m", "prompt": "seeded", "seed": 7, "max_tokens": 12, "top_k": -1}
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            omitted = await client.post("/v1/completions", json=body)
            greedy = await client.post("/v1/completions", json={**body, "temperature": 0})
            hot = await client.post("/v1/completions", json={**body, "temperature": 1.0})
    text = omitted.json()["choices"][0]["text"]
    assert text == greedy.json()["choices"][0]["text"] != hot.json()["choices"][0]["text"]


# --------------------------------------------------------------------------- chat


async def test_chat_goes_through_the_template_and_reuses_the_first_turn() -> None:
    first_turn = [{"role": "user", "content": "hi"}]
    rendered = "user: hi\nassistant: "  # the simulated tokenizer has no template: the fallback
    async with serving() as (client, _):
        response = await chat(client, messages=first_turn, max_tokens=8)
        body = response.json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        [choice] = body["choices"]
        assert choice["message"] == {"role": "assistant", "content": expected(rendered, 8)}
        assert choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == len(rendered)
        second_turn = [
            *first_turn,
            {"role": "assistant", "content": choice["message"]["content"]},
            {"role": "user", "content": [{"type": "text", "text": "more"}]},
        ]
        again = await chat(client, messages=second_turn, max_tokens=8)
        usage = again.json()["usage"]
        # Turn one's prompt and reply, except the last sampled token, were cached.
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(rendered) + 8 - 1
        rendered_two = rendered + choice["message"]["content"] + "\nuser: more\nassistant: "
        assert usage["prompt_tokens"] == len(rendered_two)
        assert again.json()["choices"][0]["message"]["content"] == expected(rendered_two, 8)


async def test_streamed_chat_equals_the_whole_one() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    async with serving() as (client, _):
        whole = await chat(client, messages=messages, max_completion_tokens=100)
        streamed = await chat(client, messages=messages, max_completion_tokens=100, stream=True)
        opening, *chunks, finish, done = sse_data(streamed)
        assert opening["object"] == "chat.completion.chunk"  # type: ignore[index]
        assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
        assert "usage" not in opening  # only with stream_options.include_usage
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)  # type: ignore[index]
        assert text == whole.json()["choices"][0]["message"]["content"]
        assert 1 < len(chunks) < 100
        assert finish["choices"] == [  # type: ignore[index]
            {"delta": {}, "index": 0, "logprobs": None, "finish_reason": "length"}
        ]
        assert done == "[DONE]"


async def test_chat_logprobs_come_one_chunk_per_token() -> None:
    messages = [{"role": "user", "content": "probe"}]
    async with serving() as (client, _):
        response = await chat(
            client, messages=messages, max_tokens=5, logprobs=True, top_logprobs=3, stream=True
        )
        _opening, *chunks, _finish, _done = sse_data(response)
        assert len(chunks) == 5
        for chunk in chunks:
            [choice] = chunk["choices"]  # type: ignore[index]
            [entry] = choice["logprobs"]["content"]
            assert entry["token"] == choice["delta"]["content"]
            assert entry["bytes"] == list(entry["token"].encode())
            best, *others = entry["top_logprobs"]
            assert best == {k: entry[k] for k in ("token", "logprob", "bytes")}  # greedy
            assert len(others) == 2 and all(o["token"].startswith("token_id:") for o in others)


async def test_an_over_long_conversation_is_refused_never_trimmed() -> None:
    turns = [{"role": "user", "content": f"turn {i} " * 4} for i in range(6)]
    async with serving(sim_model(context_length=64)) as (client, _):
        for stream in (False, True):
            response = await chat(client, messages=turns, max_tokens=4, stream=stream)
            assert response.status_code == 400
            error = error_of(response)
            assert error["code"] == "context_length_exceeded"
            assert error["param"] == "messages" and "context length of 64" in error["message"]


async def test_ignore_eos_runs_past_the_models_eos_to_max_tokens() -> None:
    async with serving(sim_model(eos_every=1)) as (client, _):  # EOS is always the next token
        ended = await complete(client, prompt="x", max_tokens=5)
        assert ended.json()["choices"][0]["finish_reason"] == "stop"
        assert ended.json()["usage"]["completion_tokens"] == 0
        ignored = await complete(client, prompt="x", max_tokens=5, ignore_eos=True)
        assert ignored.json()["choices"][0]["finish_reason"] == "length"
        assert ignored.json()["usage"]["completion_tokens"] == 5
        stopped = await complete(
            client, prompt="x", max_tokens=5, ignore_eos=True, stop_token_ids=[256]
        )
        assert stopped.json()["usage"]["completion_tokens"] == 0  # its own stop tokens still stop


# --------------------------------------------------------------------------- refusals and errors


@pytest.mark.parametrize(
    ("path", "fields", "param", "code"),
    [
        ("/v1/completions", {"n": 2}, "n", "unsupported_value"),
        ("/v1/completions", {"best_of": 3}, "best_of", "unsupported_value"),
        ("/v1/completions", {"echo": True}, "echo", "unsupported_parameter"),
        ("/v1/completions", {"suffix": "}"}, "suffix", "unsupported_parameter"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "unsupported_value"),
        ("/v1/completions", {"mirostat": 2}, "mirostat", "unsupported_parameter"),
        ("/v1/chat/completions", {"n": 3}, "n", "unsupported_value"),
        ("/v1/chat/completions", {"tools": [{"type": "x"}]}, "tools", "invalid_tools"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "xml"}},
            "response_format",
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "name": "ann"}]},
            "messages[0].name",
            "unsupported_parameter",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
            "messages[0].content[0]",
            "unsupported_value",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "extra": 1}]},
            "messages[0].extra",
            "unsupported_parameter",
        ),
    ],
)
async def test_unsupported_features_are_refused_by_name(
    path: str, fields: Json, param: str, code: str
) -> None:
    body = {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    async with serving() as (client, server):
        response = await client.post(path, json={**body, **fields})
        assert response.status_code == 400
        error = error_of(response)
        assert (error["param"], error["code"], error["type"]) == (
            param,
            code,
            "invalid_request_error",
        )
        assert param.split(".")[-1].split("[")[0] in error["message"]
        assert server.runtime.stats().actors["router"].counters.get("accepted_generate", 0) == 0


async def test_fields_that_do_not_change_the_output_are_accepted() -> None:
    async with serving() as (client, _):
        response = await chat(
            client,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=2,
            user="u1",
            store=False,
            metadata={"k": "v"},
            tools=[],
            tool_choice="none",
            response_format={"type": "text"},
            n=1,
        )
        assert response.status_code == 200


@pytest.mark.parametrize(
    ("path", "content", "param"),
    [
        ("/v1/completions", b'{"model": "m", "prompt": "x"', None),
        ("/v1/completions", b'{"prompt": 3}', "prompt"),  # no model: the only one (compat)
        ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": "hot"}', "temperature"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "temperature": -1}', "temperature"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "top_p": 0}', "top_p"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "logprobs": 21}', "logprobs"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "stop": [""]}', "stop"),
        ("/v1/completions", b'{"model": "m", "prompt": []}', "prompt"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "logit_bias": {"a": 1}}', "logit_bias"),
        ("/v1/completions", b'{"model": "m", "prompt": "x", "cache_salt": ""}', "cache_salt"),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}',
            "messages[0].role",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}',
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 5, "max_completion_tokens": 6}',
            "max_tokens",
        ),
    ],
)
async def test_invalid_requests_are_400_naming_the_field(
    path: str, content: bytes, param: str | None
) -> None:
    async with serving() as (client, _):
        response = await client.post(path, content=content)
        assert response.status_code == 400
        error = error_of(response)
        assert error["code"] == "invalid_request" and error["param"] == param
        assert error["message"]


async def test_an_unknown_model_is_404_streaming_or_not() -> None:
    async with serving() as (client, _):
        for stream in (False, True):
            response = await complete(client, model="nope", prompt="x", stream=stream)
            assert response.status_code == 404
            error = error_of(response)
            assert (error["code"], error["param"]) == ("model_not_loaded", "model")
            assert "GET /v1/models" in error["message"]
        assert (await client.get("/v1/models/nope")).status_code == 404


async def test_kv_refusals_map_to_400_and_503_with_retry_after() -> None:
    slow = sim_model(bytes_per_token=100, decode_s_per_token=0.01)
    async with (
        serving(slow, kv_budget_bytes=10_000, reservation_timeout_s=0.05) as (client, server),
        anyio.create_task_group() as tg,
    ):
        too_big = await complete(client, prompt="x" * 50, max_tokens=60)
        assert too_big.status_code == 400
        assert error_of(too_big)["code"] == "kv_request_too_large"
        assert "retry-after" not in too_big.headers

        tg.start_soon(lambda: complete(client, prompt="y" * 10, max_tokens=80))  # holds 9,000 B
        await wait_until(server.runtime, lambda: kv_reserved(server) > 0)
        for stream in (False, True):
            starved = await complete(client, prompt="z" * 10, max_tokens=20, stream=stream)
            assert starved.status_code == 503
            assert error_of(starved)["code"] == "kv_budget_exhausted"
            assert error_of(starved)["type"] == "server_error"
            assert starved.headers["retry-after"] == "1"
        tg.cancel_scope.cancel()


async def test_a_failure_before_the_first_token_is_an_http_error_and_after_it_an_sse_event() -> (
    None
):
    failing_early = sim_model("early", fail_sample_call=1)
    failing_late = sim_model("late", fail_sample_call=3)
    async with serving(failing_early, failing_late) as (client, _):
        early = await complete(client, model="early", prompt="x", max_tokens=5, stream=True)
        assert early.status_code == 500
        assert error_of(early)["code"] == "backend_error"
        late = await complete(client, model="late", prompt="x", max_tokens=5, stream=True)
        assert late.status_code == 200
        *chunks, failure = sse_data(late)
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected("x", 2)  # type: ignore[index]
        assert failure["error"]["code"] == "backend_error"  # type: ignore[index]
        assert failure["error"]["type"] == "server_error"  # type: ignore[index]
        # A logit_bias id outside the vocabulary is found at the first decode step: still a 400.
        bad_bias = await complete(client, model="late", prompt="x", logit_bias={"9999": 1})
        assert bad_bias.status_code == 400
        assert error_of(bad_bias)["param"] == "logit_bias"


async def test_a_request_drained_by_an_unload_is_503_model_unloading() -> None:
    async with (
        serving(sim_model(decode_s_per_token=0.005)) as (client, server),
        anyio.create_task_group() as tg,
    ):
        responses: list[httpx.Response] = []

        async def long_request() -> None:
            responses.append(await complete(client, prompt="long", max_tokens=2000))

        tg.start_soon(long_request)
        await wait_until(server.runtime, lambda: kv_reserved(server) > 0)
        await server.runtime.unload_model("m")
    [response] = responses
    assert response.status_code == 503
    assert error_of(response)["code"] == "model_unloading"
    assert response.headers["retry-after"] == "1"


# --------------------------------------------------------------------------- the rest


async def test_models_health_and_unknown_routes() -> None:
    async with serving(sim_model("a"), sim_model("b", context_length=128)) as (client, _):
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["context_length"]) for m in models["data"]] == [
            ("a", "model", 4096),
            ("b", "model", 128),
        ]
        assert (await client.get("/v1/models/b")).json()["id"] == "b"
        health = (await client.get("/health")).json()
        assert health == {"status": "ok", "models": {"a": "loaded", "b": "loaded"}}
        missing = await client.get("/v1/embeddings")
        assert missing.status_code == 404 and error_of(missing)["code"] is None
        wrong_method = await client.get("/v1/completions")
        assert wrong_method.status_code == 405


async def test_a_body_over_the_limit_is_413() -> None:
    server = OpenAIServer(ServerConfig(models=(sim_model(),), max_body_bytes=1000))
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await complete(client, prompt="x" * 2000)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"


async def test_session_and_cache_salt_reach_the_runtime() -> None:
    async with serving() as (client, server):
        prompt = "shared prefix one"
        await complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
        other = await complete(client, prompt=prompt, max_tokens=2, cache_salt="b")
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        same = await complete(client, prompt=prompt, max_tokens=2, cache_salt="tenant-a")
        assert same.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        system = {"role": "system", "content": "You are a careful assistant."}
        await chat(
            client, messages=[system, {"role": "user", "content": "a"}], max_tokens=2, session="s1"
        )
        ended = await server.runtime.end_session("m", "s1")
        assert ended.unpinned  # the session pinned its instructions prefix


async def test_prewarm_caches_a_chat_for_the_request_that_follows() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "system: Be brief.\nuser: Hi\nassistant: "
    async with serving() as (client, _):
        warm = await client.post(
            "/v1/prewarm", json={"model": "m", "messages": messages, "session": "s"}
        )
        assert warm.json() == {
            "model": "m",
            "status": "prewarmed",
            "prompt_tokens": len(rendered),
            "cached_tokens": 0,
            "object": "prewarm",
        }
        hot = await chat(client, messages=messages, max_tokens=4, session="s")
        assert hot.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(rendered) - 1
        assert hot.json()["choices"][0]["message"]["content"] == expected(rendered, 4)
        both = await client.post(
            "/v1/prewarm", json={"model": "m", "prompt": "x", "messages": messages}
        )
        assert both.status_code == 400 and error_of(both)["code"] == "invalid_request"
        unknown = await client.post("/v1/prewarm", json={"model": "nope", "prompt": "x"})
        assert unknown.status_code == 404 and error_of(unknown)["param"] == "model"


async def test_a_reply_that_ends_at_once_still_streams_its_framing() -> None:
    async with serving(sim_model(eos_every=1)) as (client, _):  # EOS is always the next token
        response = await chat(
            client,
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        opening, finish, usage, done = sse_data(response)
        assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # type: ignore[index]
        assert finish["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
        assert usage["usage"]["completion_tokens"] == 0  # type: ignore[index]
        assert done == "[DONE]"


# --------------------------------------------------------------------------- deadlines and stalls


async def test_a_deadline_is_504_request_timeout_on_both_endpoints() -> None:
    slow = sim_model(prefill_s_per_token=0.01)  # a 100-token prompt: 1 s of prefill
    async with serving(slow) as (client, server):
        hello = [{"role": "user", "content": "x" * 100}]
        for response in (
            await complete(client, prompt="x" * 100, timeout_s=0.05),
            await complete(client, prompt="y" * 100, timeout_s=0.05, stream=True),
            await chat(client, messages=hello, timeout_s=0.05),
        ):
            assert response.status_code == 504
            error = error_of(response)
            assert (error["code"], error["type"]) == ("request_timeout", "server_error")
            assert "timeout_s of 0.05 s" in error["message"]
            assert "retry-after" not in response.headers
        await wait_until(server.runtime, lambda: kv_reserved(server) == prefix_bytes(server))


async def test_a_stall_after_the_first_token_ends_the_stream_with_an_sse_error() -> None:
    async with serving(sim_model(decode_s_per_token=0.3)) as (client, _):
        stalled = await complete(
            client, prompt="x", max_tokens=5, stream=True, stall_timeout_s=0.03
        )
        assert stalled.status_code == 200
        *chunks, failure = sse_data(stalled)
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected("x", 1)  # type: ignore[index]
        assert failure["error"]["code"] == "stream_stalled"  # type: ignore[index]
        whole = await complete(client, prompt="x", max_tokens=5, stall_timeout_s=0.03)
        assert whole.status_code == 504
        assert error_of(whole)["code"] == "stream_stalled"


async def test_a_timeout_that_is_not_positive_seconds_is_400_naming_it() -> None:
    async with serving() as (client, _):
        for field, value in (("timeout_s", 0), ("stall_timeout_s", -1)):
            response = await complete(client, prompt="x", **{field: value})
            assert response.status_code == 400
            assert (error_of(response)["code"], error_of(response)["param"]) == (
                "invalid_request",
                field,
            )


async def test_a_prewarm_takes_timeout_s_as_a_completion_does() -> None:
    """Past its ``timeout_s`` a prewarm is a 504 ``request_timeout``; a value that is not
    positive seconds is a 400 naming ``timeout_s``; one that leaves time prewarms as without."""
    slow = sim_model(prefill_s_per_token=0.01)  # a 100-token prompt: 1 s of prefill

    async def prewarm(client: httpx.AsyncClient, prompt: str, timeout_s: object) -> httpx.Response:
        body = {"model": "m", "prompt": prompt, "timeout_s": timeout_s}
        return await client.post("/v1/prewarm", json=body)

    async with serving(slow) as (client, server):
        late = await prewarm(client, "x" * 100, 0.05)
        assert late.status_code == 504
        error = error_of(late)
        assert (error["code"], error["type"]) == ("request_timeout", "server_error")
        assert "timeout_s of 0.05 s" in error["message"]
        for bad in (0, -1.5, "soon", True):
            refused = await prewarm(client, "y", bad)
            assert refused.status_code == 400, bad
            assert (error_of(refused)["code"], error_of(refused)["param"]) == (
                "invalid_request",
                "timeout_s",
            )
        in_time = await prewarm(client, "z" * 10, 60)
        assert in_time.status_code == 200
        assert (in_time.json()["status"], in_time.json()["prompt_tokens"]) == ("prewarmed", 10)
        await wait_until(server.runtime, lambda: kv_reserved(server) == prefix_bytes(server))


def prefix_bytes(server: OpenAIServer) -> int:
    return server.runtime.stats().actors["prefix"].gauges["bytes"]
