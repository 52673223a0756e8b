"""Runtime events → OpenAI response bodies and stream chunks, one ``Render`` per request.

Streaming: ``opening()``, then ``chunk(event)`` for each ``TokensEmitted`` (the host stream has
already coalesced them, see runtime/text/coalesce.py), then ``closing(finished)``. Otherwise
``whole(events, finished)``.

Logprobs: the runtime reports token ids and the text each emitted token produced. A chosen token
is named by that text, so the tokens add up to the output (a character split across tokens shows
on the token that completed it). Alternatives that were not emitted have no text from the
runtime and are named ``token_id:<id>``, vLLM's convention for the same case.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import ClassVar

import msgspec

from runtime.messages import Finished, FinishReason, TokenLogprob, TokensEmitted, Usage
from runtime.server import schema as wire

FINISH_REASONS: dict[FinishReason, str] = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def wire_usage(usage: Usage) -> wire.WireUsage:
    """The runtime's exact counts; cached tokens are the prompt tokens restored from the cache."""
    return wire.WireUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=wire.PromptTokensDetails(cached_tokens=usage.cached_prompt_tokens),
    )


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

    def opening(self) -> list[wire.Chunk]:
        """Chunks sent before any text."""
        return []

    @abc.abstractmethod
    def chunk(self, event: TokensEmitted) -> wire.Chunk: ...

    def chunks(self, event: TokensEmitted) -> list[wire.Chunk]:
        """What one event sends: one chunk here; none or several where text is parsed (tools)."""
        return [self.chunk(event)]

    def closing(self, finished: Finished) -> list[wire.Chunk]:
        """The chunk carrying ``finish_reason``, then the usage chunk if the client asked for it."""
        chunks = [self._finish_chunk(finish_reason(finished))]
        if self.include_usage:
            chunks.append(self._usage_chunk(wire_usage(finished.usage)))
        return chunks

    @abc.abstractmethod
    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> msgspec.Struct: ...

    @abc.abstractmethod
    def _finish_chunk(self, reason: str) -> wire.Chunk: ...

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

    def chunk(self, event: TokensEmitted) -> wire.TextCompletion:
        logprobs = self._logprobs([event], self._text_offset)
        self._text_offset += len(event.text)
        return self._completion([wire.CompletionChoice(text=event.text, logprobs=logprobs)])

    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> wire.TextCompletion:
        choice = wire.CompletionChoice(
            text="".join(e.text for e in events),
            logprobs=self._logprobs(events, 0),
            finish_reason=finish_reason(finished),
        )
        return self._completion([choice], wire_usage(finished.usage))

    def _finish_chunk(self, reason: str) -> wire.TextCompletion:
        return self._completion([wire.CompletionChoice(text="", finish_reason=reason)])

    def _usage_chunk(self, usage: wire.WireUsage) -> wire.TextCompletion:
        return self._completion([], usage)

    def _completion(
        self,
        choices: list[wire.CompletionChoice],
        usage: wire.WireUsage | None = None,
    ) -> wire.TextCompletion:
        return wire.TextCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._chunk_usage if usage is None else usage,
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
    """``/v1/chat/completions``: a role chunk, content deltas, chat logprobs."""

    prompt_field = "messages"

    def opening(self) -> list[wire.Chunk]:
        return [self._chunk([wire.ChatChunkChoice(delta=wire.Delta(role="assistant", content=""))])]

    def chunk(self, event: TokensEmitted) -> wire.ChatCompletionChunk:
        choice = wire.ChatChunkChoice(
            delta=wire.Delta(content=event.text), logprobs=self._logprobs([event])
        )
        return self._chunk([choice])

    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> wire.ChatCompletion:
        choice = wire.ChatChoice(
            message=wire.AssistantMessage(content="".join(e.text for e in events)),
            finish_reason=finish_reason(finished),
            logprobs=self._logprobs(events),
        )
        return wire.ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=wire_usage(finished.usage),
        )

    def _finish_chunk(self, reason: str) -> wire.ChatCompletionChunk:
        return self._chunk([wire.ChatChunkChoice(delta=wire.Delta(), finish_reason=reason)])

    def _usage_chunk(self, usage: wire.WireUsage) -> wire.ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(
        self,
        choices: list[wire.ChatChunkChoice],
        usage: wire.WireUsage | None = None,
    ) -> wire.ChatCompletionChunk:
        return wire.ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._chunk_usage if usage is None else usage,
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
