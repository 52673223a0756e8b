"""Chat responses with tools: the output split into ``content`` and ``tool_calls``.

Non-streaming: ``message.tool_calls`` lists the calls, ``content`` is the text around them (None
when there is none) and ``finish_reason`` is ``"tool_calls"`` when the model called and stopped
(a reply cut by ``max_tokens`` says ``"length"``). Streaming: content deltas as the text is
decided, and for each call one chunk with ``delta.tool_calls[0]`` = ``{index, id, type: "function",
function: {name, arguments: ""}}`` followed by chunks with pieces of its ``arguments`` as the model
writes them (OpenAI's shape: the official client's stream accumulation joins the pieces by
``index``). The parser holds back text that may start a call block, so a stream's chunks can lag
the tokens by a few characters.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from runtime.messages import Finished, FinishReason, TokensEmitted
from runtime.server import schema as wire
from runtime.server.render import ChatRender, finish_reason, wire_usage
from runtime.text.tool_calls import (
    ArgumentsAdded,
    ParsedOutput,
    TextAdded,
    ToolCallParser,
    ToolCallStarted,
)


class ChatToolRender(ChatRender):
    """``ChatRender`` for a request whose output is parsed for calls to the functions ``names``."""

    def __init__(
        self,
        request_id: str,
        model: str,
        *,
        logprobs: bool,
        include_usage: bool,
        names: Sequence[str],
        parallel: bool,
    ) -> None:
        super().__init__(request_id, model, logprobs=logprobs, include_usage=include_usage)
        self._parser = ToolCallParser(names, parallel=parallel)

    def chunks(self, event: TokensEmitted) -> list[wire.Chunk]:
        chunks = self._deltas(self._parser.feed(event.text))
        logprobs = self._logprobs([event])
        if logprobs is None:
            return list(chunks)
        # Logprobs ride on the event's first chunk, or on an empty delta while text is held back.
        first = chunks[0].choices[0] if chunks else wire.ChatChunkChoice(delta=wire.Delta())
        return [
            self._chunk([wire.ChatChunkChoice(delta=first.delta, logprobs=logprobs)]),
            *chunks[1:],
        ]

    def closing(self, finished: Finished) -> list[wire.Chunk]:
        chunks: list[wire.Chunk] = list(self._deltas(self._parser.finish()))
        chunks.append(self._finish_chunk(self._reason(finished)))
        if self.include_usage:
            chunks.append(self._usage_chunk(wire_usage(finished.usage)))
        return chunks

    def whole(self, events: Sequence[TokensEmitted], finished: Finished) -> wire.ChatCompletion:
        parsed = self._parser.feed("".join(e.text for e in events)) + self._parser.finish()
        content = "".join(p.text for p in parsed if isinstance(p, TextAdded))
        calls = [
            wire.WireToolCall(
                id=call.id,
                function=wire.WireFunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in self._parser.calls
        ]
        message = wire.AssistantMessage(
            content=content or (None if calls else ""),
            tool_calls=calls or msgspec.UNSET,
        )
        choice = wire.ChatChoice(
            message=message, finish_reason=self._reason(finished), logprobs=self._logprobs(events)
        )
        return wire.ChatCompletion(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=wire_usage(finished.usage),
        )

    def _reason(self, finished: Finished) -> str:
        if self._parser.calls and finished.reason is FinishReason.STOP:
            return "tool_calls"
        return finish_reason(finished)

    def _deltas(self, parsed: Sequence[ParsedOutput]) -> list[wire.ChatCompletionChunk]:
        deltas: list[wire.Delta] = []
        for piece in parsed:
            match piece:
                case TextAdded(text=text):
                    deltas.append(wire.Delta(content=text))
                case ToolCallStarted(index=index, id=call_id, name=name):
                    call = wire.DeltaToolCall(
                        index=index,
                        id=call_id,
                        type="function",
                        function=wire.DeltaFunction(name=name),
                    )
                    deltas.append(wire.Delta(tool_calls=[call]))
                case ArgumentsAdded(index=index, fragment=fragment):
                    call = wire.DeltaToolCall(
                        index=index, function=wire.DeltaFunction(arguments=fragment)
                    )
                    deltas.append(wire.Delta(tool_calls=[call]))
        return [self._chunk([wire.ChatChunkChoice(delta=delta)]) for delta in deltas]
