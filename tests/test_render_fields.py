"""``ChatRender``'s reasoning split and the timings, fed the events a request's stream brings."""

from __future__ import annotations

import itertools

import msgspec

from runtime.messages import (
    Finished,
    FinishReason,
    ReusePath,
    Started,
    TokenLogprob,
    TokensEmitted,
    Usage,
)
from runtime.server.render import ChatRender
from runtime.server.timings import RequestClock

USAGE = Usage(prompt_tokens=10, cached_prompt_tokens=4, completion_tokens=5)


def started(*, reasoning_open: bool) -> Started:
    return Started(
        request_id="r", incarnation=1, sequence_id=1, epoch=1, prompt_tokens=10,
        cached_tokens=4, path=ReusePath.TRIM, reasoning_open=reasoning_open,
    )  # fmt: skip


def emitted(text: str, token: int) -> TokensEmitted:
    return TokensEmitted(request_id="r", incarnation=1, token_ids=(token,), text=text)


FINISHED = Finished(request_id="r", incarnation=1, reason=FinishReason.STOP, usage=USAGE)


def streamed_deltas(render: ChatRender, events: list[TokensEmitted]) -> list[dict[str, str]]:
    chunks = [chunk for event in events for chunk in render.chunk(event)]
    chunks += render.closing(FINISHED)
    deltas = [msgspec.to_builtins(c)["choices"] for c in chunks]
    return [choices[0]["delta"] for choices in deltas if choices and choices[0]["delta"]]


def test_a_block_the_model_opens_streams_as_reasoning_then_content() -> None:
    pieces = ["<th", "ink>\nI should", " greet.</th", "ink>\n", "\nHello", "!"]
    events = [emitted(text, i) for i, text in enumerate(pieces)]
    render = ChatRender("r", "m", logprobs=False, include_usage=False)
    render.started(started(reasoning_open=False))
    deltas = streamed_deltas(render, events)
    assert deltas == [
        {"reasoning_content": "I should"},
        {"reasoning_content": " greet."},
        {"content": "Hello"},
        {"content": "!"},
    ]
    whole = ChatRender("r", "m", logprobs=False, include_usage=False)
    whole.started(started(reasoning_open=False))
    message = msgspec.to_builtins(whole.whole(events, FINISHED))["choices"][0]["message"]
    assert message == {
        "content": "Hello!",
        "role": "assistant",
        "reasoning_content": "I should greet.",
    }


def test_logprobs_ride_on_a_held_token_and_a_closing_tag_in_one_event_splits_it() -> None:
    render = ChatRender("r", "m", logprobs=True, include_usage=False)
    render.started(started(reasoning_open=True))
    logprob = (TokenLogprob(token=1, logprob=-0.5),)
    held = TokensEmitted(request_id="r", incarnation=1, token_ids=(1,), text="</", logprobs=logprob)
    [chunk] = render.chunk(held)  # nothing to show yet, but the token's logprobs go out
    choice = msgspec.to_builtins(chunk)["choices"][0]
    assert choice["delta"] == {"content": ""} and len(choice["logprobs"]["content"]) == 1
    closed = TokensEmitted(
        request_id="r", incarnation=1, token_ids=(2,), text="think>Yes", logprobs=logprob
    )
    [answer] = render.chunk(closed)  # the block held nothing: no reasoning delta
    assert msgspec.to_builtins(answer)["choices"][0]["delta"] == {"content": "Yes"}
    fresh = ChatRender("r", "m", logprobs=True, include_usage=False)
    fresh.started(started(reasoning_open=True))
    both = TokensEmitted(
        request_id="r", incarnation=1, token_ids=(3,), text="plan</think>Yes", logprobs=logprob
    )
    first, second = (msgspec.to_builtins(c)["choices"][0] for c in fresh.chunk(both))
    assert first["delta"] == {"reasoning_content": "plan"} and first["logprobs"] is not None
    assert second["delta"] == {"content": "Yes"} and second["logprobs"] is None


def test_timings_come_from_the_event_times() -> None:
    ticks = itertools.count(start=1.0, step=0.25)  # each event is a quarter second after the last
    clock = RequestClock(clock=lambda: next(ticks))
    clock.saw(started(reasoning_open=False))  # 1.0
    clock.saw(emitted("a", 1))  # 1.25: the first token
    clock.saw(emitted("b", 2))  # not read: only the first token's time counts
    clock.saw(FINISHED)  # 1.5
    timings = clock.timings(USAGE)
    assert (timings.prompt_n, timings.cache_n, timings.predicted_n) == (6, 4, 5)
    assert timings.prompt_ms == 250.0 and timings.predicted_ms == 250.0
    assert timings.prompt_per_second == 24.0 and timings.predicted_per_token_ms == 50.0
    nothing = RequestClock(clock=lambda: 2.0)
    nothing.saw(started(reasoning_open=False))
    nothing.saw(FINISHED)
    still = nothing.timings(Usage(prompt_tokens=3, cached_prompt_tokens=3, completion_tokens=0))
    assert still.prompt_per_second is None and still.predicted_per_second is None
    assert still.prompt_n == 0 and still.predicted_ms == 0.0
