"""Tools over HTTP, in process: refusals on the simulated backend; forced calls, the official
client's view of them and a two-step round trip on a tiny MLX model (its grammar engine)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import sim_spec
from runtime.testing.tiny_models import tiny_model_path
from runtime.testing.tiny_tokenizer import SPECIAL_TOKENS

pytestmark = pytest.mark.anyio

Json = dict[str, Any]
WEATHER: Json = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
# The client's stream helper parses arguments itself, and only for strict functions.
STRICT_WEATHER: Json = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
NO_ARGUMENTS: Json = {"type": "function", "function": {"name": "now"}}
ASK: list[Json] = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextlib.asynccontextmanager
async def serving(spec: ModelSpec) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    server = OpenAIServer(
        ServerConfig(models=(spec,), runtime=RuntimeConfig(kv_budget_bytes=1 << 28))
    )
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, server


def simulated() -> ModelSpec:
    return sim_spec("m", chunk=8)


def tiny_llama() -> ModelSpec:
    return ModelSpec(name="m", path=str(tiny_model_path("llama")), backend="mlx")


async def chat(client: httpx.AsyncClient, **body: object) -> httpx.Response:
    fields = {"model": "m", "temperature": 0, "max_tokens": 4, "messages": ASK, **body}
    return await client.post("/v1/chat/completions", json=fields)


def answered(
    call_id: str = "call_1", arguments: str = '{"city": "Paris", "unit": "c"}'
) -> list[Json]:
    """The conversation after the model called get_weather and the client ran it."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'},
    ]


# --------------------------------------------------------------------------- refusals


def renamed(name: str) -> Json:
    return {"type": "function", "function": {**WEATHER["function"], "name": name}}


def with_parameters(parameters: object) -> Json:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"tools": {"get_weather": {}}}, "tools", "invalid_tools"),
        ({"tools": [{"type": "web_search"}]}, "tools", "invalid_tools"),
        ({"tools": [renamed("get weather")]}, "tools[0].function.name", "invalid_tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "invalid_tools"),
        (
            {"tools": [with_parameters({"type": "string"})]},
            "tools[0].function.parameters",
            "invalid_schema",
        ),
        ({"tools": [with_parameters([1])]}, "tools[0].function.parameters", "invalid_schema"),
        (
            {"tools": [with_parameters({"type": "object", "properties": {"a": {"type": "nope"}}})]},
            "tools[0].function.parameters",
            "invalid_schema",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "invalid_tools"),
        ({"tool_choice": "required"}, "tool_choice", "invalid_tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "unknown_tool",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
            "invalid_request",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "content": "21"}]},
            "messages[1].tool_call_id",
            "invalid_tools",
        ),
        (
            {"messages": answered()[:1] + answered()[2:]},
            "messages[1].tool_call_id",
            "invalid_tools",
        ),
        (
            {"messages": answered(arguments="city=Paris")},
            "messages[1].tool_calls[0].function.arguments",
            "invalid_tools",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
            "invalid_tools",
        ),
    ],
)
async def test_bad_tools_are_refused_naming_the_field(fields: Json, param: str, code: str) -> None:
    async with serving(simulated()) as (client, server):
        response = await chat(client, **fields)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            param,
            code,
            "invalid_request_error",
        )
        assert server.runtime.stats().actors["router"].counters.get("accepted_generate", 0) == 0


# --------------------------------------------------------------------------- the prompt


async def test_tools_reach_the_prompt_unless_tool_choice_is_none() -> None:
    async with serving(simulated()) as (client, _):
        plain = (await chat(client)).json()["usage"]["prompt_tokens"]
        auto = (await chat(client, tools=[WEATHER, NO_ARGUMENTS])).json()
        none = (await chat(client, tools=[WEATHER], tool_choice="none")).json()
    assert auto["usage"]["prompt_tokens"] > plain + len('"get_weather"')
    assert none["usage"]["prompt_tokens"] == plain
    # The simulated model's text holds no call: the reply is text, as without tools.
    assert "tool_calls" not in auto["choices"][0]["message"]
    assert auto["choices"][0]["finish_reason"] == "length"


async def test_a_conversation_with_a_call_and_its_result_is_accepted() -> None:
    async with serving(simulated()) as (client, _):
        response = await chat(client, tools=[WEATHER], messages=answered())
        assert response.status_code == 200, response.text


async def test_forcing_a_call_on_a_model_without_a_grammar_engine_is_refused() -> None:
    async with serving(simulated()) as (client, _):
        response = await chat(client, tools=[WEATHER], tool_choice="required")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "constraints_unsupported"


# --------------------------------------------------------------------------- a tiny MLX model


async def test_a_named_function_is_called_with_arguments_valid_under_its_schema() -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    async with serving(tiny_llama()) as (client, _):
        whole = (
            await chat(client, tools=[WEATHER, NO_ARGUMENTS], tool_choice=forced, max_tokens=80)
        ).json()
        stream = await chat(
            client, tools=[WEATHER, NO_ARGUMENTS], tool_choice=forced, max_tokens=80, stream=True
        )
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["city"] in ("Paris", "Rome") and arguments["unit"] in ("c", "f")
    deltas = [
        json.loads(block.removeprefix("data: "))["choices"][0]
        for block in stream.text.split("\n\n")
        if block.startswith("data: {")
    ]
    pieces = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert pieces[0]["id"].startswith("call_") and pieces[0]["function"]["name"] == "get_weather"
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_the_official_client_makes_a_round_trip_and_step_two_reuses_step_one() -> None:
    async with serving(tiny_llama()) as (_, server):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
            client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http)
            first = await client.chat.completions.create(
                model="m",
                messages=ASK,
                tools=[STRICT_WEATHER],
                tool_choice="required",
                temperature=0,
                max_tokens=80,
            )
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls
            call = message.tool_calls[0]
            async with client.chat.completions.stream(
                model="m",
                messages=ASK,
                tools=[STRICT_WEATHER],
                tool_choice="required",
                temperature=0,
                max_tokens=80,
            ) as stream:
                streamed = await stream.get_final_completion()
            assert streamed.choices[0].message.tool_calls is not None
            [again] = streamed.choices[0].message.tool_calls
            assert (again.function.name, again.function.arguments) == (
                call.function.name,
                call.function.arguments,
            )
            second = await client.chat.completions.create(
                model="m",
                messages=[
                    *ASK,
                    message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
                ],
                tools=[STRICT_WEATHER],
                temperature=0,
                max_tokens=4,
            )
    assert second.choices[0].message.role == "assistant"
    assert second.usage is not None and first.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # Step two's prompt starts with step one's (its tools, the question, the assistant header).
    assert details.cached_tokens >= first.usage.prompt_tokens


async def test_a_prewarm_with_the_tools_caches_the_prompt_its_chat_request_sends() -> None:
    async with serving(simulated()) as (client, _):
        warm = await client.post(
            "/v1/prewarm", json={"model": "m", "messages": ASK, "tools": [WEATHER]}
        )
        assert warm.status_code == 200, warm.text
        usage = (await chat(client, tools=[WEATHER])).json()["usage"]
        refused = await client.post(
            "/v1/prewarm", json={"model": "m", "prompt": "x", "tools": [WEATHER]}
        )
    assert warm.json()["prompt_tokens"] == usage["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"


async def test_required_calls_end_at_a_repeated_call_instead_of_running_to_max_tokens() -> None:
    """Left free to make several calls, a model may repeat its call until max_tokens (SmolLM2
    does). Here the tiny model cannot end (its end tokens are banned) and the one function takes no
    arguments, so its second call repeats the first: the repeat ends the reply, dropped, as
    "tool_calls" (before the fix: four calls and "length")."""
    tokenizer = load_tokenizer(tiny_model_path("llama"))
    specials = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))  # every way to end
    clock: Json = {
        "type": "function",
        "function": {
            "name": "now",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
    ask: Json = {
        "tools": [clock],
        "tool_choice": "required",
        "max_tokens": 200,
        "logit_bias": {str(token): -100 for token in specials},
    }
    async with serving(tiny_llama()) as (client, _):
        whole = (await chat(client, **ask)).json()
        stream = await chat(client, **ask, stream=True, stream_options={"include_usage": True})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]
    ]
    assert calls == [("now", "{}")]
    assert whole["usage"]["completion_tokens"] < 200
    events = [
        json.loads(block.removeprefix("data: "))
        for block in stream.text.split("\n\n")
        if block.startswith("data: {")
    ]
    pieces = [
        piece
        for event in events
        for choice in event["choices"]
        for piece in choice["delta"].get("tool_calls", [])
    ]
    assert {piece["index"] for piece in pieces} == {0}  # the repeat never reached the client
    assert "".join(p["function"]["arguments"] for p in pieces) == "{}"
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "tool_calls"
    assert events[-1]["usage"]["completion_tokens"] < 200
