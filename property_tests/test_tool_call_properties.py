"""Tool-call parsing is chunking-invariant: any split of an output gives the whole output's
content and calls (the streamed ``delta.tool_calls`` a client accumulates equal ``tool_calls``).

Outputs are drawn from pieces that stress the parser: calls whose arguments stream (a closing tag
and escaped quotes inside a string among them), calls read whole, blocks that are not calls, calls
cut short, tag fragments, stray closing tags and whitespace, joined by arbitrary text; each is
then split at random points, as a tokenizer's detokenized pieces would be. Settings come from the
active Hypothesis profile.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from runtime.text.tool_calls import (
    ArgumentsAdded,
    ParsedOutput,
    TextAdded,
    ToolCallParser,
    ToolCallStarted,
)

NAMES = ("get_weather", "add")
PIECES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"s": "a \\" } </tool_call> {", "t": [1, {}]}}',
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
    '<tool_call>{"arguments": {}, "name": "add"}</tool_call>',
    '<tool_call>{"name": "add", "arguments": {"a": ',
    '"}',
    "}",
    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
    "<tool_call>not json</tool_call>",
    "<tool_call>",
    "</tool_call>",
    "<tool",
    "<",
    "\n",
    "  ",
    "é",
    "text",
)


def parse(pieces: list[str], parallel: bool) -> tuple[str, list[tuple[int, str, str, str]]]:
    counter = itertools.count()
    parser = ToolCallParser(NAMES, parallel=parallel, new_id=lambda: f"call_{next(counter)}")
    events: list[ParsedOutput] = [e for piece in pieces for e in parser.feed(piece)]
    events += parser.finish()
    content = "".join(e.text for e in events if isinstance(e, TextAdded))
    started = {e.index: (e.id, e.name) for e in events if isinstance(e, ToolCallStarted)}
    arguments = {i: "" for i in started}
    for e in events:
        if isinstance(e, ArgumentsAdded):
            assert e.index in started  # a call's arguments never come before its name
            arguments[e.index] += e.fragment
    calls = [(i, *started[i], arguments[i]) for i in sorted(started)]
    assert [call[1] for call in calls] == [c.id for c in parser.calls]
    return content, calls


@st.composite
def split_output(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    return text, [text[a:b] for a, b in itertools.pairwise(bounds)]


@given(split_output(), st.booleans())
def test_any_split_gives_the_whole_outputs_content_and_calls(
    output: tuple[str, list[str]], parallel: bool
) -> None:
    text, pieces = output
    assert parse(pieces, parallel) == parse([text], parallel)


@given(split_output())
def test_output_without_calls_is_content_verbatim(output: tuple[str, list[str]]) -> None:
    text, pieces = output
    content, calls = parse(pieces, parallel=True)
    if not calls:
        assert content == text
