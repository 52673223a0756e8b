"""Chat responses with tools: the output split into ``content`` and ``tool_calls``.

Non-streaming: ``message.tool_calls`` lists the calls, ``content`` is the text around them (None
when empty), and ``finish_reason`` is ``"tool_calls"`` when the model called and stopped. Streaming,
in OpenAI's shape: content deltas, and for each call one chunk naming it (``arguments: ""``) then
chunks with pieces of its arguments, joined by ``index`` in the client. The parser holds back text
that may start a call, so chunks can lag the tokens by a few characters. With ``end_on_repeat`` a
call repeating an earlier one ends the reply and ``ended_early`` tells generation.py to cancel the
rest. See docs/structured.md, "In the output".
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from runtime.messages import Finished, FinishReason, TokensEmitted
from runtime.server import replies as wire
from runtime.server.render import ChatRender, finish_reason
from runtime.text.tool_calls import (
    ArgumentsAdded,
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
        end_on_repeat: bool = False,
    ) -> None:
        super().__init__(request_id, model, logprobs=logprobs, include_usage=include_usage)
        self._parser = ToolCallParser(names, parallel=parallel, end_on_repeat=end_on_repeat)
        # Reads the raw text as it comes, streaming or not (the output's own parser reads a
        # whole reply only at its end), to see a repeat as soon as its block closes.
        self._watch = ToolCallParser(names, parallel=parallel, end_on_repeat=end_on_repeat)

    def observe(self, event: TokensEmitted) -> None:
        self._watch.feed(event.text)

    @property
    def ended_early(self) -> bool:
        return self._watch.repeated

    def _content_deltas(self, text: str, final: bool) -> list[wire.Delta]:
        parsed = self._parser.feed(text) if text else []
        if final:
            parsed += self._parser.finish()
        deltas: list[wire.Delta] = []
        for piece in parsed:
            match piece:
                case TextAdded(text=added):
                    deltas.append(wire.Delta(content=added))
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
        return deltas

    def _message(self, content: str, reasoning: str | msgspec.UnsetType) -> wire.AssistantMessage:
        parsed = self._parser.feed(content) + self._parser.finish()
        text = "".join(p.text for p in parsed if isinstance(p, TextAdded))
        calls = [
            wire.WireToolCall(
                id=call.id,
                function=wire.WireFunctionCall(name=call.name, arguments=call.arguments),
            )
            for call in self._parser.calls
        ]
        return wire.AssistantMessage(
            content=text or (None if calls else ""),
            reasoning_content=reasoning,
            tool_calls=calls or msgspec.UNSET,
        )

    def _finish_reason(self, finished: Finished) -> str:
        ended = finished.reason is FinishReason.STOP or self._parser.repeated
        if self._parser.calls and ended:
            return "tool_calls"
        return finish_reason(finished)
