"""Runtime events → OpenAI response bodies and stream chunks, one ``Render`` per request.

Streaming: ``started(event)``, ``opening()``, ``chunk(event)`` per ``TokensEmitted``, then
``closing(finished)``; otherwise ``whole(events, finished)``. The finish chunk and a whole response
carry llama-server's ``timings`` (timings.py). Chat output is split into ``reasoning_content`` and
``content`` (runtime/text/reasoning.py), a reasoning delta and a content delta in separate chunks.
Logprobs name a chosen token by the text it produced, so the tokens add up to the output;
alternatives not emitted have no text and are named ``token_id:<id>``, as vLLM does.

See docs/http.md.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from runtime.messages import Finished, FinishReason, Started, TokenLogprob, TokensEmitted, Usage
from runtime.server import replies as wire
from runtime.server.shutdown import SHUTDOWN_FINISH_REASON
from runtime.server.timings import RequestClock
from runtime.text.reasoning import ReasoningSplitter, Split, split_reasoning

FINISH_REASONS: dict[FinishReason, str] = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def wire_usage(usage: Usage) -> wire.WireUsage:
    """The runtime's exact counts; cached tokens are the prompt tokens restored from the cache."""
    return wire.WireUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=wire.PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
        max_tokens_clamped_to=_clamped(usage),
    )


def _clamped(usage: Usage) -> int | msgspec.UnsetType:
    clamped = usage.max_tokens_clamped_to
    return msgspec.UNSET if clamped is None else clamped


def finish_reason(finished: Finished) -> str:
    return FINISH_REASONS.get(finished.reason, "stop")


class Render(abc.ABC):
    """Builds one request's response or chunks; ``prompt_field`` names its prompt on the wire."""

    prompt_field: ClassVar[str]

    def __init__(self, request_id: str, model: str, *, logprobs: bool, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.clock = RequestClock()  # the caller shows it every event (``saw``) as it comes

    def started(self, event: Started) -> None:
        """The request's ``Started`` (before any text): what the response needs of it."""
        self.clock.saw(event)

    def opening(self) -> list[wire.Chunk]:
        """Chunks sent before any text."""
        return []

    def observe(self, event: TokensEmitted) -> None:  # noqa: B027 - most renders need none
        """Each text event as it comes, streaming or not (before ``chunk``)."""

    @property
    def ended_early(self) -> bool:
        """The reply is complete before the generation ended (a tool call repeated): the
        response cancels the rest, and the cancelled request ends as ``Finished`` would."""
        return False

    @abc.abstractmethod
    def chunk(self, event: TokensEmitted) -> list[wire.Chunk]:
        """The chunks for ``event``: none when all its text is held back for now (a tag that may
        be starting), several when it holds reasoning and content, or tool calls."""

    def closing(self, finished: Finished) -> list[wire.Chunk]:
        """Text still held, the chunk carrying ``finish_reason`` and the timings, then the usage
        chunk if the client asked for it."""
        timings = self.clock.timings(finished.usage)
        chunks = [*self._held(), self._finish_chunk(self._finish_reason(finished), timings)]
        if self.include_usage:
            chunks.append(self._usage_chunk(wire_usage(finished.usage)))
        return chunks

    def stopped(self, error: wire.ErrorDetail) -> list[wire.Chunk]:
        """The end of a stream the server stopped (its shutdown): text still held, then a chunk
        with finish reason "abort" and ``error``. No usage: the request ended without its
        terminal event, which carries the exact counts."""
        last = self._finish_chunk(SHUTDOWN_FINISH_REASON, msgspec.UNSET)
        return [*self._held(), msgspec.structs.replace(last, error=error)]

    @abc.abstractmethod
    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> msgspec.Struct: ...

    def _held(self) -> list[wire.Chunk]:
        """Chunks for text held back until the end."""
        return []

    def _finish_reason(self, finished: Finished) -> str:
        return finish_reason(finished)

    @abc.abstractmethod
    def _finish_chunk(
        self, reason: str, timings: wire.Timings | msgspec.UnsetType
    ) -> wire.Chunk: ...

    @abc.abstractmethod
    def _usage_chunk(self, usage: wire.WireUsage) -> wire.Chunk: ...

    @property
    def _chunk_usage(self) -> msgspec.UnsetType | None:
        # With include_usage every chunk has "usage": null and the last one the counts (OpenAI).
        return None if self.include_usage else msgspec.UNSET


class CompletionRender(Render):
    """``/v1/completions``: ``text_completion`` objects; legacy logprobs (parallel lists)."""

    prompt_field = "prompt"

    def __init__(self, request_id: str, model: str, *, logprobs: bool, include_usage: bool) -> None:
        super().__init__(request_id, model, logprobs=logprobs, include_usage=include_usage)
        self._text_offset = 0

    def chunk(self, event: TokensEmitted) -> list[wire.Chunk]:
        logprobs = self._logprobs([event], self._text_offset)
        self._text_offset += len(event.text)
        return [self._completion([wire.CompletionChoice(text=event.text, logprobs=logprobs)])]

    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> wire.TextCompletion:
        choice = wire.CompletionChoice(
            text="".join(e.text for e in events),
            logprobs=self._logprobs(events, 0),
            finish_reason=finish_reason(finished),
        )
        timings = self.clock.timings(finished.usage)
        return self._completion([choice], wire_usage(finished.usage), timings)

    def _finish_chunk(
        self, reason: str, timings: wire.Timings | msgspec.UnsetType
    ) -> wire.TextCompletion:
        choice = wire.CompletionChoice(text="", finish_reason=reason)
        return self._completion([choice], timings=timings)

    def _usage_chunk(self, usage: wire.WireUsage) -> wire.TextCompletion:
        return self._completion([], usage)

    def _completion(
        self,
        choices: list[wire.CompletionChoice],
        usage: wire.WireUsage | None = None,
        timings: wire.Timings | msgspec.UnsetType = msgspec.UNSET,
    ) -> wire.TextCompletion:
        return wire.TextCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._chunk_usage if usage is None else usage,
            timings=timings,
        )

    def _logprobs(
        self, events: Sequence[TokensEmitted], text_offset: int
    ) -> wire.CompletionLogprobs | None:
        if not self.logprobs:
            return None
        tokens: list[str] = []
        values: list[float] = []
        tops: list[dict[str, float]] = []
        offsets: list[int] = []
        for event in events:
            for entry, text in zip(event.logprobs, _token_texts(event), strict=False):
                tokens.append(text)
                values.append(entry.logprob)
                tops.append({name: value for name, value, _ in _alternatives(entry, text)})
                offsets.append(text_offset)
                text_offset += len(text)
        return wire.CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )


class ChatRender(Render):
    """``/v1/chat/completions``: a role chunk, reasoning and content deltas, chat logprobs."""

    prompt_field = "messages"

    def __init__(self, request_id: str, model: str, *, logprobs: bool, include_usage: bool) -> None:
        super().__init__(request_id, model, logprobs=logprobs, include_usage=include_usage)
        self._reasoning_open = False
        self._splitter = ReasoningSplitter(opened=False)

    def started(self, event: Started) -> None:
        super().started(event)
        self._reasoning_open = event.reasoning_open
        self._splitter = ReasoningSplitter(opened=event.reasoning_open)

    def opening(self) -> list[wire.Chunk]:
        return [self._chunk([wire.ChatChunkChoice(delta=wire.Delta(role="assistant", content=""))])]

    def chunk(self, event: TokensEmitted) -> list[wire.Chunk]:
        return self._deltas(self._splitter.feed(event.text), self._logprobs([event]))

    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> wire.ChatCompletion:
        split = split_reasoning("".join(e.text for e in events), opened=self._reasoning_open)
        message = self._message(split.content, split.reasoning or msgspec.UNSET)
        choice = wire.ChatChoice(
            message=message,
            finish_reason=self._finish_reason(finished),  # after _message: it may decide it
            logprobs=self._logprobs(events),
        )
        return wire.ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=wire_usage(finished.usage),
            timings=self.clock.timings(finished.usage),
        )

    def _held(self) -> list[wire.Chunk]:
        return self._deltas(self._splitter.finish(), None, final=True)

    def _message(self, content: str, reasoning: str | msgspec.UnsetType) -> wire.AssistantMessage:
        """The whole reply's message from its content (reasoning split off already)."""
        return wire.AssistantMessage(content=content, reasoning_content=reasoning)

    def _content_deltas(self, text: str, final: bool) -> list[wire.Delta]:
        """Deltas for content text as it is decided (``final``: no more text comes)."""
        return [wire.Delta(content=text)] if text else []

    def _deltas(
        self, split: Split, logprobs: wire.ChoiceLogprobs | None, *, final: bool = False
    ) -> list[wire.Chunk]:
        """A reasoning delta, then the content's deltas, each only if it has text; the logprobs
        ride on the first (an empty content delta carries them when all the text is held)."""
        deltas = []
        if split.reasoning:
            deltas.append(wire.Delta(reasoning_content=split.reasoning))
        deltas += self._content_deltas(split.content, final)
        if not deltas and logprobs is not None:
            deltas.append(wire.Delta(content=""))
        return [
            self._chunk([wire.ChatChunkChoice(delta=delta, logprobs=logprobs if i == 0 else None)])
            for i, delta in enumerate(deltas)
        ]

    def _finish_chunk(
        self, reason: str, timings: wire.Timings | msgspec.UnsetType
    ) -> wire.ChatCompletionChunk:
        choice = wire.ChatChunkChoice(delta=wire.Delta(), finish_reason=reason)
        return self._chunk([choice], timings=timings)

    def _usage_chunk(self, usage: wire.WireUsage) -> wire.ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(
        self,
        choices: list[wire.ChatChunkChoice],
        usage: wire.WireUsage | None = None,
        timings: wire.Timings | msgspec.UnsetType = msgspec.UNSET,
    ) -> wire.ChatCompletionChunk:
        return wire.ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._chunk_usage if usage is None else usage,
            timings=timings,
        )

    def _logprobs(self, events: Sequence[TokensEmitted]) -> wire.ChoiceLogprobs | None:
        if not self.logprobs:
            return None
        content = [
            wire.TokenLogprob(
                token=text,
                logprob=entry.logprob,
                bytes=list(text.encode()),
                top_logprobs=[
                    wire.TopLogprob(token=name, logprob=value, bytes=raw)
                    for name, value, raw in _alternatives(entry, text)
                ],
            )
            for event in events
            for entry, text in zip(event.logprobs, _token_texts(event), strict=False)
        ]
        return wire.ChoiceLogprobs(content=content)


def _token_texts(event: TokensEmitted) -> list[str]:
    """Each token's text. With logprobs the stream has one token per event (never coalesced)."""
    return [event.text, *("" for _ in event.token_ids[1:])]


def _alternatives(entry: TokenLogprob, chosen: str) -> list[tuple[str, float, list[int] | None]]:
    """(name, logprob, bytes) of each alternative; only the chosen one has text to show."""
    return [
        (chosen, value, list(chosen.encode()))
        if token == entry.token
        else (f"token_id:{token}", value, None)
        for token, value in entry.top
    ]
