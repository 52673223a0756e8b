"""The neighbours' field names, ``cache_prompt``, ``id_slot``, ``reasoning_content`` and
``timings`` on the HTTP API (simulated backend, httpx's ASGI transport)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from runtime.server import OpenAIServer
from tests.loop_checks import LoopBackend, on_uvloop
from tests.test_http_server import (
    chat,
    complete,
    error_of,
    expected,
    serving,
    sim_model,
    sse_data,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> LoopBackend:
    # One loop, the server's (uvicorn runs uvloop): these check what each field means, the same
    # on either loop; the other HTTP modules run both.
    return on_uvloop()


Json = dict[str, Any]


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]  # type: ignore[no-any-return]


def prefilled(server: OpenAIServer) -> int:
    runtime = server.runtime
    engine = next(name for name in runtime.stats().actors if name.startswith("engine:m#"))
    return runtime.stats().actors[engine].counters.get("prefilled_tokens", 0)


async def test_the_neighbours_names_mean_what_ours_mean() -> None:
    # A short context: n_predict=-1 and a null max_tokens each generate the rest of it.
    async with serving(sim_model(context_length=256)) as (client, _):
        plain = text_of(await complete(client, prompt="x", max_tokens=30))
        ours = text_of(await complete(client, prompt="x", max_tokens=30, repetition_penalty=50.0))
        llama = text_of(await complete(client, prompt="x", max_tokens=30, repeat_penalty=50.0))
        assert llama == ours != plain
        for window in ("penalty_context", "repeat_last_n", "repetition_context_size"):
            off = await complete(
                client, prompt="x", max_tokens=30, repeat_penalty=50.0, **{window: 0}
            )
            assert text_of(off) == plain, window  # a window of 0 turns the penalties off
        whole = await complete(client, prompt="x", max_tokens=30, repeat_penalty=50.0,
                               repeat_last_n=-1)  # fmt: skip
        assert text_of(whole) == ours  # the whole history covers the 64 tokens of ours
        limited = await complete(client, prompt="x", n_predict=5)
        assert limited.json()["usage"]["completion_tokens"] == 5
        unlimited = await complete(client, prompt="x", n_predict=-1)
        rest = await complete(client, prompt="x", max_tokens=None)
        assert unlimited.json()["usage"] == rest.json()["usage"]
        chat_limited = await chat(client, messages=[{"role": "user", "content": "hi"}], n_predict=3)
        assert chat_limited.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("body", "agreeing", "param"),
    [
        (
            {"repetition_penalty": 1.1, "repeat_penalty": 1.2},
            {"repeat_penalty": 1.1},
            "repeat_penalty",
        ),
        (
            {"repetition_context_size": 20, "presence_context_size": 30},
            {"presence_context_size": 20},
            "presence_context_size",
        ),
        ({"penalty_context": 64, "repeat_last_n": 32}, {"repeat_last_n": 64}, "repeat_last_n"),
        ({"max_tokens": 6, "n_predict": 5}, {"n_predict": 6}, "n_predict"),
        ({"session": "mine", "id_slot": 2}, {"session": "slot-2"}, "id_slot"),
    ],
)
async def test_two_names_for_one_setting_that_disagree_are_refused(
    body: Json, agreeing: Json, param: str
) -> None:
    async with serving() as (client, _):
        response = await complete(client, prompt="x", **body)
        error = error_of(response)
        assert response.status_code == 400
        assert error["code"] == "conflicting_parameters" and error["param"] == param
        assert all(name in error["message"] for name in body)
        # The same value under both names is one setting.
        assert (await complete(client, prompt="x", **{**body, **agreeing})).status_code == 200


async def test_chat_token_limits_and_bad_values_of_the_neighbours_names() -> None:
    hello = [{"role": "user", "content": "hi"}]
    async with serving() as (client, _):
        both = await chat(client, messages=hello, n_predict=4, max_completion_tokens=5)
        assert error_of(both)["code"] == "conflicting_parameters"
        assert (await chat(client, messages=hello, n_predict=4, max_tokens=4)).status_code == 200
        for field, value in (("n_predict", 0), ("n_predict", -2), ("id_slot", -3)):
            response = await complete(client, prompt="x", **{field: value})
            assert response.status_code == 400
            assert error_of(response)["param"] == field and error_of(response)["code"] == (
                "invalid_request"
            )
        for unknown in ("mirostat", "dynatemp_range"):  # typical_p is ours: test_http_compat.py
            response = await complete(client, prompt="x", **{unknown: 1})
            assert error_of(response)["code"] == "unsupported_parameter"
            assert error_of(response)["param"] == unknown


async def test_cache_prompt_false_prefills_the_whole_prompt() -> None:
    prompt = "a prompt long enough to be worth caching"
    async with serving() as (client, server):
        await complete(client, prompt=prompt, max_tokens=2)
        before = prefilled(server)
        cold = await complete(client, prompt=prompt, max_tokens=2, cache_prompt=False)
        assert prefilled(server) - before == len(prompt)
        assert cold.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cold.json()["timings"]["cache_n"] == 0
        assert cold.json()["timings"]["prompt_n"] == len(prompt)
        assert cold.json()["choices"][0]["text"] == expected(prompt, 2)
        warm = await complete(client, prompt=prompt, max_tokens=2, cache_prompt=True)
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_id_slot_is_a_session() -> None:
    system = {"role": "system", "content": "You are a careful assistant."}
    async with serving() as (client, server):
        response = await chat(
            client, messages=[system, {"role": "user", "content": "a"}], max_tokens=2, id_slot=3
        )
        assert response.status_code == 200
        ended = await server.runtime.end_session("m", "slot-3")
        assert ended.unpinned  # the slot's session pinned its instructions prefix
        any_slot = await chat(
            client, messages=[system, {"role": "user", "content": "b"}], max_tokens=2, id_slot=-1
        )
        assert any_slot.status_code == 200


def check_timings(timings: Json, usage: Json) -> None:
    assert set(timings) == {
        "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
        "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n",
    }  # fmt: skip
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["cache_n"] == cached
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert timings["prompt_ms"] >= 0 and timings["predicted_ms"] >= 0


async def test_timings_on_responses_and_on_the_final_chunk() -> None:
    hello = [{"role": "user", "content": "hello there"}]
    async with serving() as (client, _):
        first = await complete(client, prompt="time me", max_tokens=4)
        check_timings(first.json()["timings"], first.json()["usage"])
        again = await complete(client, prompt="time me", max_tokens=4)
        assert again.json()["timings"]["cache_n"] > 0
        check_timings(again.json()["timings"], again.json()["usage"])
        whole = await chat(client, messages=hello, max_tokens=4)
        check_timings(whole.json()["timings"], whole.json()["usage"])
        for endpoint in (complete, chat):
            body: Json = {"messages": hello} if endpoint is chat else {"prompt": "time me"}
            streamed = sse_data(
                await endpoint(
                    client,
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                    **body,
                )
            )
            chunks = [c for c in streamed if isinstance(c, dict)]
            finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
            assert [("timings" in c) for c in chunks] == [c in finish for c in chunks]
            check_timings(finish[0]["timings"], chunks[-1]["usage"])


async def test_reasoning_opened_by_the_prompt_is_reasoning_content() -> None:
    # A final assistant message is continued: the prompt ends inside an open <think> block, as
    # a thinking model's template leaves it.
    thinking = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>"}]
    rendered = "user: Hi\nassistant: <think>"
    async with serving() as (client, _):
        whole = await chat(client, messages=thinking, max_tokens=12)
        message = whole.json()["choices"][0]["message"]
        assert message["reasoning_content"] == expected(rendered, 12).strip()
        assert message["content"] == ""
        streamed = sse_data(await chat(client, messages=thinking, max_tokens=12, stream=True))
        deltas = [c["choices"][0]["delta"] for c in streamed if isinstance(c, dict)]
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        assert reasoning == message["reasoning_content"]
        assert "".join(d.get("content", "") for d in deltas) == ""
        plain = await chat(client, messages=thinking[:1], max_tokens=4)
        assert "reasoning_content" not in plain.json()["choices"][0]["message"]


async def test_incoming_reasoning_content_is_stripped_from_history_and_kept_in_a_prefill() -> None:
    user = {"role": "user", "content": "Hi"}
    answer = {"role": "assistant", "content": "Hello."}
    reasoned = {**answer, "reasoning_content": "They greet me; greet back."}
    follow_up = {"role": "user", "content": "And?"}
    async with serving() as (client, _):
        without = await chat(client, messages=[user, answer, follow_up], max_tokens=2)
        with_it = await chat(client, messages=[user, reasoned, follow_up], max_tokens=2)
        assert with_it.json()["usage"]["prompt_tokens"] == without.json()["usage"]["prompt_tokens"]
        assert with_it.json()["choices"] == without.json()["choices"]
        prefill = await chat(client, messages=[user, reasoned], max_tokens=2)
        block = "<think>\nThey greet me; greet back.\n</think>\n\n"
        short = await chat(client, messages=[user, answer], max_tokens=2)
        assert prefill.json()["usage"]["prompt_tokens"] == (
            short.json()["usage"]["prompt_tokens"] + len(block)
        )
        wrong = await chat(client, messages=[{**user, "reasoning_content": "no"}], max_tokens=2)
        assert error_of(wrong)["param"] == "messages[0].reasoning_content"


async def test_the_official_client_reads_reasoning_content_and_timings() -> None:
    openai = pytest.importorskip("openai")
    thinking = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>"}]
    async with serving() as (client, _):
        sdk = openai.AsyncOpenAI(
            api_key="unused", base_url="http://test/v1", http_client=client, max_retries=0
        )
        whole = await sdk.chat.completions.create(
            model="m", messages=thinking, max_tokens=6, temperature=0,
            extra_body={"repeat_penalty": 1.0, "cache_prompt": False},
        )  # fmt: skip
        message = whole.choices[0].message
        assert message.content == "" and message.reasoning_content  # type: ignore[attr-defined]
        assert whole.timings["predicted_n"] == whole.usage.completion_tokens  # type: ignore[attr-defined,union-attr]
        stream = await sdk.chat.completions.create(
            model="m", messages=thinking, max_tokens=6, temperature=0, stream=True
        )
        reasoning = [
            getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
            async for chunk in stream
            if chunk.choices
        ]
        assert "".join(reasoning) == message.reasoning_content  # type: ignore[attr-defined]
