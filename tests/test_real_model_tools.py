"""A two-step tool round trip against a real ``mlxrt serve`` on SmolLM2-135M, with the official
``openai`` client: a forced call (its arguments follow the schema), the tool's result sent back,
an answer; the streamed call equals the whole one, and step two reuses step one's prompt."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.http_client import HOST, Server
from bench.serving import mlxrt_serve, running
from runtime.backends.model_source import prepare_model
from runtime.backends.model_store import DEFAULT_MODEL
from runtime.messages import ModelSpec

pytestmark = pytest.mark.real_model

CLIENT_TIMEOUT_S = 120.0  # the CPU is shared; a reply takes seconds
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "strict": True,  # the client's stream helper parses the arguments of strict functions
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION: Any = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(real_gguf: Callable[[str], Path]) -> Iterator[Server]:
    real_gguf(DEFAULT_MODEL)  # skips (or fails under CI) like every real-model test
    path = prepare_model(ModelSpec(name=DEFAULT_MODEL, path=DEFAULT_MODEL)).path
    with running([mlxrt_serve(path, DEFAULT_MODEL)]) as [started]:
        yield started  # the process is always stopped on the way out


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        api_key="none", base_url=f"http://{HOST}:{server.port}/v1", timeout=CLIENT_TIMEOUT_S
    ) as opened:
        yield opened


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_two_step_round_trip_through_mlxrt_serve(client: openai.OpenAI, choice: str) -> None:
    forced: Any = (
        "required"
        if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )
    ask: Any = {"model": DEFAULT_MODEL, "tools": [WEATHER], "temperature": 0, "max_tokens": 60}
    ask["extra_body"] = {"cache_salt": choice}  # each case reuses only its own prompts
    # One call (with parallel calls, a repeat ends the reply: the test after this one).
    ask["parallel_tool_calls"] = False
    first = client.chat.completions.create(messages=QUESTION, tool_choice=forced, **ask)
    reply = first.choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    assert reply.message.tool_calls is not None
    [call] = reply.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)

    with client.chat.completions.stream(messages=QUESTION, tool_choice=forced, **ask) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.tool_calls
    [again] = streamed.message.tool_calls
    assert (again.function.name, again.function.arguments) == (
        "get_weather",
        call.function.arguments,
    )
    assert again.function.parsed_arguments == arguments

    result = {"city": arguments["city"], "temperature_c": 21, "sky": "sunny"}
    second = client.chat.completions.create(
        messages=[
            *QUESTION,
            reply.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
        ],
        **ask,
    )
    answer = second.choices[0]
    assert answer.message.tool_calls is None and answer.message.content
    assert first.usage is not None and second.usage is not None
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    # Step one's prompt (the tools section, the question, the assistant header) is reused.
    assert details.cached_tokens >= first.usage.prompt_tokens
    print(
        f"\n{choice}: step 2 reused {details.cached_tokens} of {second.usage.prompt_tokens} prompt "
        f"tokens (step 1: {first.usage.prompt_tokens} prompt + {first.usage.completion_tokens} "
        f"completion); answer: {answer.message.content!r}"
    )


def test_required_with_parallel_calls_ends_after_the_calls(client: openai.OpenAI) -> None:
    """Free to make several calls, SmolLM2-135M repeats its call (4 identical get_weather(Paris),
    "length", before the fix): the repeat ends the reply, which says "tool_calls"."""
    ask: Any = {"model": DEFAULT_MODEL, "tools": [WEATHER], "temperature": 0, "max_tokens": 120}
    ask["extra_body"] = {"cache_salt": "parallel"}
    reply = client.chat.completions.create(messages=QUESTION, tool_choice="required", **ask)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(set(calls)) == len(calls)
    assert reply.usage is not None and reply.usage.completion_tokens < 120
    with client.chat.completions.stream(messages=QUESTION, tool_choice="required", **ask) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
