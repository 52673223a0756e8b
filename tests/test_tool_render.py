"""Tool calls in chat responses: the whole response, and the stream as the official ``openai``
client accumulates it (its ``ChatCompletionStreamState``, what ``client.chat.completions.stream``
runs), from the same output split into tokens at every kind of boundary."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from runtime.messages import Finished, FinishReason, TokenLogprob, TokensEmitted, Usage
from runtime.server.replies import encoder
from runtime.server.tool_render import ChatToolRender

NAMES = ("get_weather", "add")
OUTPUT = (
    "Checking both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
USAGE = Usage(prompt_tokens=10, completion_tokens=7)


def render(*, logprobs: bool = False, parallel: bool = True) -> ChatToolRender:
    return ChatToolRender(
        "chatcmpl-1", "m", logprobs=logprobs, include_usage=True, names=NAMES, parallel=parallel
    )


def events(text: str, size: int, *, logprobs: bool = False) -> list[TokensEmitted]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        TokensEmitted(
            request_id="r",
            incarnation=1,
            token_ids=(i,),
            text=piece,
            logprobs=(TokenLogprob(token=i, logprob=-0.5),) if logprobs else (),
        )
        for i, piece in enumerate(pieces)
    ]


def finished(reason: FinishReason = FinishReason.STOP) -> Finished:
    return Finished(request_id="r", incarnation=1, reason=reason, usage=USAGE)


def accumulated(emitted: list[TokensEmitted], end: Finished, **options: bool) -> dict[str, object]:
    """The stream's chunks as JSON, read back by the openai client and accumulated by it."""
    stream = render(**options)
    chunks = [*stream.opening()]
    for event in emitted:
        chunks += stream.chunk(event)
    chunks += stream.closing(end)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate_json(encoder.encode(chunk)))
    completion = state.get_final_completion()
    return completion.choices[0].model_dump(include={"message", "finish_reason"})


def whole(emitted: list[TokensEmitted], end: Finished, **options: bool) -> dict[str, object]:
    body = json.loads(encoder.encode(render(**options).whole(emitted, end)))
    return body["choices"][0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, len(OUTPUT)])
def test_the_client_accumulates_the_stream_into_the_whole_responses_calls(size: int) -> None:
    emitted = events(OUTPUT, size)
    body = whole(emitted, finished())
    assert body["finish_reason"] == "tool_calls"
    message = body["message"]
    assert message["content"] == "Checking both."
    assert [(c["type"], c["function"]["name"]) for c in message["tool_calls"]] == [
        ("function", "get_weather"),
        ("function", "add"),
    ]
    assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"a": 1, "b": 2}
    streamed = accumulated(emitted, finished())
    assert streamed["finish_reason"] == "tool_calls"
    got = streamed["message"]
    assert isinstance(got, dict)
    assert got["content"] == message["content"]
    # Ids are minted per response; everything else matches.
    assert [
        (c["type"], c["function"]["name"], c["function"]["arguments"]) for c in got["tool_calls"]
    ] == [
        ("function", c["function"]["name"], c["function"]["arguments"])
        for c in message["tool_calls"]
    ]
    assert all(c["id"].startswith("call_") for c in got["tool_calls"])


def test_only_calls_give_null_content_and_text_only_gives_no_tool_calls() -> None:
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    body = whole(events(call, 4), finished())
    assert body["message"]["content"] is None and len(body["message"]["tool_calls"]) == 1
    plain = whole(events("Just text.", 4), finished())
    assert plain["message"] == {"content": "Just text.", "role": "assistant"}
    assert plain["finish_reason"] == "stop"


def test_a_reply_cut_by_max_tokens_keeps_its_calls_but_says_length() -> None:
    cut = OUTPUT + "\n<tool_call>{"
    body = whole(events(cut, 6), finished(FinishReason.LENGTH))
    assert body["finish_reason"] == "length"
    assert len(body["message"]["tool_calls"]) == 2
    assert body["message"]["content"].endswith("<tool_call>{")  # the unclosed block stays text


def test_logprobs_come_for_every_token_even_while_text_is_held_back() -> None:
    emitted = events(OUTPUT, 4, logprobs=True)
    stream = render(logprobs=True)
    chunks = [chunk for event in emitted for chunk in stream.chunk(event)]
    carried = [
        entry
        for chunk in chunks
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content
    ]
    assert len(carried) == len(emitted)


def test_without_parallel_calls_the_response_has_the_first_call_only() -> None:
    body = whole(events(OUTPUT, 7), finished(), parallel=False)
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("size", [1, 3, 8])
def test_reasoning_before_the_calls_is_split_off_whole_and_streamed(size: int) -> None:
    thought = "<think>\nThe user wants weather and a sum.\n</think>\n\n"
    emitted = events(thought + OUTPUT, size)
    body = whole(emitted, finished())
    assert body["message"]["reasoning_content"] == "The user wants weather and a sum."
    assert body["message"]["content"] == "Checking both."
    assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == ["get_weather", "add"]
    assert body["finish_reason"] == "tool_calls"
    stream = render()
    chunks = [*stream.opening()]
    for event in emitted:
        chunks += stream.chunk(event)
    chunks += stream.closing(finished())
    deltas = [json.loads(encoder.encode(c))["choices"] for c in chunks]
    reasoning = "".join(c[0]["delta"].get("reasoning_content", "") for c in deltas if c)
    assert reasoning == body["message"]["reasoning_content"]
    streamed = accumulated(emitted, finished())
    assert [c["function"]["name"] for c in streamed["message"]["tool_calls"]] == [  # type: ignore[index]
        "get_weather",
        "add",
    ]
