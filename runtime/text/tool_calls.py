"""Tool calls in the model's output: an incremental parser, and the grammar that forces them.

The format is the Hermes one the fallback prompt asks for and that Qwen-style templates use
natively: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. ``ToolCallParser`` splits
output into content and calls as it streams, holding back text that may still start a tag, so any
chunking gives the same content and calls as the whole text. ``tool_call_grammar`` is the constraint
for ``tool_choice`` "required" or a named function; ``end_on_repeat`` drops a call that repeats an
earlier one, so a small model looping on one call is stopped there.

Which blocks are calls, the grammar and repeats: docs/structured.md, "In the output".
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import msgspec

from runtime.messages import GrammarConstraint, Tool, ToolCall
from runtime.text.tools import CALL_CLOSE, CALL_OPEN

__all__ = [
    "ArgumentsAdded",
    "ParsedOutput",
    "TextAdded",
    "ToolCallParser",
    "ToolCallStarted",
    "new_call_id",
    "tool_call_grammar",
]

# The start of a block whose arguments can be passed on as written (ends at the object's brace).
_STREAMED_HEAD: Final = re.compile(
    r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{'
)
# Separators the grammar writes JSON with: fixed, so a constrained model cannot ramble in spaces.
_JSON_LAYOUT: Final = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class TextAdded(msgspec.Struct, frozen=True):
    """Content text, in order."""

    text: str


class ToolCallStarted(msgspec.Struct, frozen=True):
    """Call number ``index`` (from 0): its id and function name; its arguments follow."""

    index: int
    id: str
    name: str


class ArgumentsAdded(msgspec.Struct, frozen=True):
    """A piece of call ``index``'s arguments (JSON text); the pieces concatenate."""

    index: int
    fragment: str


ParsedOutput = TextAdded | ToolCallStarted | ArgumentsAdded


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _StreamedCall:
    """A call whose arguments object is being passed on as written: tracks where it ends.

    ``index`` is None for a call that is dropped (``parallel=False``, not the first)."""

    def __init__(self, index: int | None, call_id: str, name: str) -> None:
        self.index = index
        self.id = call_id
        self.name = name
        self.arguments = ""
        self.complete = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def take(self, text: str) -> int:
        """Adds what of ``text`` belongs to the arguments; returns how many characters it took."""
        taken = self._scan(text)
        self.arguments += text[:taken]
        return taken

    def _scan(self, text: str) -> int:
        for at, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == "<":  # no JSON outside a string has it: the object was cut short
                self.complete = True
                return at
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
            if self._depth == 0 and not self._in_string:
                self.complete = True
                return at + 1
        return len(text)


class ToolCallParser:
    """Splits streamed output text into content and tool calls; ``feed`` pieces, then ``finish``.

    ``names``: the functions that may be called (a block naming another one stays content).
    ``parallel=False``: calls after the first are dropped (the prompt asked for at most one).
    ``calls`` holds the calls whose blocks have ended (or, after ``finish``, were cut short).
    """

    def __init__(
        self,
        names: Iterable[str],
        *,
        parallel: bool = True,
        end_on_repeat: bool = False,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self._names = frozenset(names)
        self._parallel = parallel
        self._end_on_repeat = end_on_repeat
        self._new_id = new_id
        self.calls: list[ToolCall] = []
        self.repeated = False  # (end_on_repeat) a call repeated an earlier one: nothing follows
        self._held_call: list[ParsedOutput] = []  # (end_on_repeat) the open call's events
        self._pending = ""  # text not yet given out: it may start a tag, or border a call
        self._in_call = False
        self._held_space = ""  # whitespace before an open block: dropped if it is a call
        self._after_call = False  # whitespace right after a call is dropped
        self._streamed: _StreamedCall | None = None  # the open block, once it is a call

    def feed(self, text: str) -> list[ParsedOutput]:
        if self.repeated:
            return []
        self._pending += text
        out: list[ParsedOutput] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ParsedOutput]:
        """The end of the output: whatever was held back is content (an unclosed block too)."""
        out: list[ParsedOutput] = []
        if self.repeated:
            return out
        if self._streamed is not None:
            self._end_streamed(out)
        elif self._in_call:
            self._text(out, self._held_space + CALL_OPEN + self._pending)
        else:
            self._text(out, self._pending)
        self._pending, self._held_space, self._in_call = "", "", False
        return out

    def _step(self, out: list[ParsedOutput]) -> bool:
        """Decides what it can of the pending text; True when another step may decide more."""
        if self._in_call:
            return self._step_in_block(out)
        start = self._pending.find(CALL_OPEN)
        if start >= 0:
            before, self._pending = self._pending[:start], self._pending[start + len(CALL_OPEN) :]
            text = before.rstrip()
            self._text(out, text)
            self._held_space = before[len(text) :]
            self._in_call = True
            return True
        # Keep back a tail that may begin a tag, and trailing whitespace a call may follow.
        keep = _partial_tag_length(self._pending)
        decided = self._pending[: len(self._pending) - keep]
        text = decided.rstrip()
        self._text(out, text)
        self._pending = self._pending[len(text) :]
        return False

    def _step_in_block(self, out: list[ParsedOutput]) -> bool:
        streamed = self._streamed
        if streamed is None:
            head = _STREAMED_HEAD.match(self._pending)
            if head is None or head.group(1) not in self._names:
                return self._close_whole_block(out)
            streamed = self._streamed = self._start_streamed(out, head.group(1))
            self._pending = self._pending[head.end() - 1 :]  # from the arguments' brace
        if not streamed.complete:
            taken = streamed.take(self._pending)
            fragment, self._pending = self._pending[:taken], self._pending[taken:]
            if fragment and streamed.index is not None:
                self._call_event(out, ArgumentsAdded(streamed.index, fragment))
            if not streamed.complete:
                return False
        end = self._pending.find(CALL_CLOSE)  # what is left of the block is not looked at
        if end < 0:
            return False
        self._pending = self._pending[end + len(CALL_CLOSE) :]
        self._end_streamed(out)
        return not self.repeated

    def _start_streamed(self, out: list[ParsedOutput], name: str) -> _StreamedCall:
        index = len(self.calls) if self._parallel or not self.calls else None
        streamed = _StreamedCall(index, self._new_id(), name)
        if index is not None:
            self._call_event(out, ToolCallStarted(index, streamed.id, name))
        self._held_space = ""
        return streamed

    def _end_streamed(self, out: list[ParsedOutput]) -> None:
        streamed = self._streamed
        assert streamed is not None
        if streamed.index is not None:
            call = ToolCall(id=streamed.id, name=streamed.name, arguments=streamed.arguments)
            self._add_call(out, call, self._held_call)
        self._held_call = []
        self._streamed, self._in_call, self._after_call = None, False, True

    def _call_event(self, out: list[ParsedOutput], event: ParsedOutput) -> None:
        """An event of the open call: held until it closes when repeats end the output."""
        (self._held_call if self._end_on_repeat else out).append(event)

    def _add_call(
        self, out: list[ParsedOutput], call: ToolCall, events: list[ParsedOutput]
    ) -> None:
        """A complete call, and its events not given out yet; a repeat (``end_on_repeat``) is
        dropped and ends the output."""
        if self._end_on_repeat and any(_same_call(call, earlier) for earlier in self.calls):
            self.repeated = True
            self._pending, self._held_space = "", ""
            return
        self.calls.append(call)
        out.extend(events)

    def _close_whole_block(self, out: list[ParsedOutput]) -> bool:
        end = self._pending.find(CALL_CLOSE)
        if end < 0:
            return False
        body, self._pending = self._pending[:end], self._pending[end + len(CALL_CLOSE) :]
        self._in_call = False
        self._close_block(out, body)
        return not self.repeated

    def _close_block(self, out: list[ParsedOutput], body: str) -> None:
        call = self._parse_call(body)
        if call is None:
            self._text(out, self._held_space + CALL_OPEN + body + CALL_CLOSE)
        else:
            if self._parallel or not self.calls:
                index = len(self.calls)
                events: list[ParsedOutput] = [
                    ToolCallStarted(index, call.id, call.name),
                    ArgumentsAdded(index, call.arguments),
                ]
                self._add_call(out, call, events)
            self._after_call = True
        self._held_space = ""

    def _text(self, out: list[ParsedOutput], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if text:
            self._after_call = False
            out.append(TextAdded(text))

    def _parse_call(self, body: str) -> ToolCall | None:
        try:
            found = json.loads(body)
        except ValueError:
            return None
        if not isinstance(found, dict):
            return None
        name = found.get("name")
        arguments = found.get("arguments", found.get("parameters"))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if name not in self._names or not isinstance(arguments, dict):
            return None
        text = json.dumps(arguments, ensure_ascii=False)
        return ToolCall(id=self._new_id(), name=str(name), arguments=text)


def _same_call(one: ToolCall, other: ToolCall) -> bool:
    """The same function with the same arguments (as JSON values: spacing does not count)."""
    if one.name != other.name:
        return False
    try:
        return bool(json.loads(one.arguments) == json.loads(other.arguments))
    except ValueError:  # a call cut short: its text is all there is
        return one.arguments == other.arguments


def _partial_tag_length(text: str) -> int:
    """The length of the longest tail of ``text`` that is a proper prefix of the opening tag."""
    for length in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def parse_tool_calls(
    text: str, names: Iterable[str], *, parallel: bool = True
) -> tuple[str, list[ToolCall]]:
    """The whole output's content and calls (what ``ToolCallParser`` streams, at once)."""
    parser = ToolCallParser(names, parallel=parallel)
    pieces = [*parser.feed(text), *parser.finish()]
    return "".join(p.text for p in pieces if isinstance(p, TextAdded)), parser.calls


def tool_call_grammar(
    tools: Sequence[Tool], *, only: str | None = None, parallel: bool = True
) -> GrammarConstraint:
    """The output must be call blocks: of ``only`` (a tool's name) or of any of ``tools``; one
    block, or with ``parallel`` one or more separated by newlines.

    Raises ``ValueError`` when ``only`` is not one of the tools. Schema keywords the grammar
    engine cannot enforce are skipped (``lenient``), as OpenAI does for non-strict functions.
    """
    chosen = [tool for tool in tools if only is None or tool.name == only]
    if not chosen:
        raise ValueError(f"no tool is named {only!r}")
    rules = [f"call_{i}: {_call_rule(tool)}" for i, tool in enumerate(chosen)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(chosen)))
    # The newline the model may write after a call is allowed to end the output too.
    start = 'start: call ("\\n" call)* "\\n"?' if parallel else "start: call"
    grammar = "\n".join([start, f"call: {alternatives}", *rules]) + "\n"
    return GrammarConstraint(grammar=grammar, syntax="lark")


def _call_rule(tool: Tool) -> str:
    schema: dict[str, Any] = json.loads(tool.parameters)
    guidance = {**_JSON_LAYOUT, "lenient": True, **schema.get("x-guidance", {})}
    schema = {**schema, "x-guidance": guidance}
    head = json.dumps(f'{CALL_OPEN}\n{{"name": "{tool.name}", "arguments": ')
    tail = json.dumps(f"}}\n{CALL_CLOSE}")
    return f"{head} %json {json.dumps(schema)} {tail}"
