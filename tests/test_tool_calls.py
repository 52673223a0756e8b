"""The tool-call parser on whole and streamed output, and the grammar that forces calls."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence

import pytest

from runtime.messages import Tool
from runtime.text.tool_calls import (
    ArgumentsAdded,
    ParsedOutput,
    TextAdded,
    ToolCallParser,
    ToolCallStarted,
    parse_tool_calls,
    tool_call_grammar,
)

NAMES = ("get_weather", "add")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def ids() -> itertools.count[int]:
    return itertools.count()


def streamed(
    pieces: Sequence[str], *, parallel: bool = True, end_on_repeat: bool = False
) -> list[ParsedOutput]:
    counter = ids()
    parser = ToolCallParser(
        NAMES,
        parallel=parallel,
        end_on_repeat=end_on_repeat,
        new_id=lambda: f"call_{next(counter)}",
    )
    out = [event for piece in pieces for event in parser.feed(piece)]
    return out + parser.finish()


def test_a_call_alone_has_no_content_and_its_arguments_as_json_text() -> None:
    content, calls = parse_tool_calls(WEATHER, NAMES)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")


def test_text_around_calls_is_content_without_the_whitespace_next_to_calls() -> None:
    content, calls = parse_tool_calls(f"Let me check.\n{WEATHER}\n{ADD}\nDone.", NAMES)
    assert content == "Let me check.Done."
    assert [c.name for c in calls] == ["get_weather", "add"]


def test_blocks_that_are_not_calls_stay_content_as_written() -> None:
    unknown = '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>'
    broken = '<tool_call>{"name": "add", "arguments": </tool_call>'
    for text in (unknown, broken, "<tool_call>no json", 'a <tool_call>{"name": "add"}</tool_call>'):
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_arguments_written_as_a_json_string_and_the_parameters_key_are_read() -> None:
    text = '<tool_call>{"name": "add", "parameters": "{\\"a\\": 1}"}</tool_call>'
    _, calls = parse_tool_calls(text, NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1}')]


def test_without_parallel_calls_only_the_first_call_is_kept() -> None:
    _, calls = parse_tool_calls(f"{WEATHER}\n{ADD}", NAMES, parallel=False)
    assert [c.name for c in calls] == ["get_weather"]


def test_a_tag_split_across_pieces_is_held_back_until_it_is_decided() -> None:
    events = streamed(
        ["Hi <tool", "_call>\n", '{"name": "add", "arguments": {}}', "</tool_", "call>"]
    )
    assert events == [
        TextAdded("Hi"),
        ToolCallStarted(0, "call_0", "add"),
        ArgumentsAdded(0, "{}"),
    ]
    assert streamed(["a <tool", "box> b"]) == [TextAdded("a"), TextAdded(" <toolbox> b")]


def test_arguments_are_passed_on_as_the_model_writes_them() -> None:
    head = '<tool_call>{"name": "add", "arguments": '
    events = streamed(
        ["x ", head, '{"s": "a \\" </tool_call>', ' }", ', '"n": [1]}}', "</tool_call> y"]
    )
    assert events == [
        TextAdded("x"),
        ToolCallStarted(0, "call_0", "add"),
        ArgumentsAdded(0, '{"s": "a \\" </tool_call>'),  # inside a string: not the block's end
        ArgumentsAdded(0, ' }", '),
        ArgumentsAdded(0, '"n": [1]}'),
        TextAdded("y"),
    ]


def test_a_call_cut_short_keeps_the_arguments_written_so_far() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"a": 1, "b'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b')]
    # Something no JSON has outside a string ends the arguments there.
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', NAMES
    )
    assert [c.arguments for c in calls] == ['{"a": 1']


def test_every_split_of_an_output_gives_the_whole_outputs_content_and_calls() -> None:
    text = f" x {WEATHER}\n  {ADD} y <tool_call>bad</tool_call> <tool"
    whole = streamed([text])
    for cut in range(len(text) + 1):
        for second in range(cut, len(text) + 1, 7):
            assert merged(streamed([text[:cut], text[cut:second], text[second:]])) == merged(whole)


def test_a_repeated_call_ends_the_output_when_asked_and_is_dropped() -> None:
    spaced = WEATHER.replace('{"city": "Paris"}', '{ "city" :"Paris" }')  # the same JSON value
    text = f"{WEATHER}\n{ADD}\n{spaced}\n{ADD}\nmore text"
    expected = ("", [(0, "get_weather", '{"city": "Paris"}'), (1, "add", '{"a": 1, "b": 2}')])
    for cut in range(len(text) + 1):
        assert merged(streamed([text[:cut], text[cut:]], end_on_repeat=True)) == expected, cut
    parser = ToolCallParser(NAMES, end_on_repeat=True)
    assert len(parser.feed(WEATHER + "\n" + WEATHER)) == 2  # the first call's two events
    assert parser.feed("x") == parser.finish() == []
    assert parser.repeated and [c.name for c in parser.calls] == ["get_weather"]
    # A call's events wait for its block to close: a repeat's never get out.
    held = ToolCallParser(NAMES, end_on_repeat=True)
    assert held.feed(WEATHER[:-5]) == [] and len(held.feed(WEATHER[-5:])) == 2
    # Without it every call is kept, repeats too, and arguments stream as written.
    _, calls = parse_tool_calls(f"{WEATHER}\n{WEATHER}", NAMES)
    assert len(calls) == 2
    assert streamed([WEATHER[:-5]])[0] == ToolCallStarted(0, "call_0", "get_weather")


def test_different_calls_of_one_function_are_not_repeats() -> None:
    rome = WEATHER.replace("Paris", "Rome")
    parser = ToolCallParser(NAMES, end_on_repeat=True)
    parser.feed(f"{WEATHER}\n{rome}")
    assert not parser.repeated
    assert [json.loads(c.arguments)["city"] for c in parser.calls] == ["Paris", "Rome"]


def merged(events: Sequence[ParsedOutput]) -> tuple[str, list[tuple[int, str, str]]]:
    """Content and (index, name, arguments) per call, however the events were split."""
    content = "".join(e.text for e in events if isinstance(e, TextAdded))
    calls = {e.index: [e.name, ""] for e in events if isinstance(e, ToolCallStarted)}
    for e in events:
        if isinstance(e, ArgumentsAdded):
            calls[e.index][1] += e.fragment
    return content, [(i, name, args) for i, (name, args) in sorted(calls.items())]


# --------------------------------------------------------------------------- the grammar

WEATHER_TOOL = Tool(
    name="get_weather",
    parameters=json.dumps(
        {
            "type": "object",
            "properties": {"city": {"$ref": "#/$defs/city"}},
            "required": ["city"],
            "additionalProperties": False,
            "$defs": {"city": {"type": "string"}},
        }
    ),
)
ADD_TOOL = Tool(
    name="add",
    parameters='{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}',
)


@pytest.fixture(scope="module")
def accepts() -> Callable[[str, str], bool]:
    """``accepts(grammar, text)``: the grammar engine lets the text through, to its end."""
    llguidance = pytest.importorskip("llguidance")
    llguidance_hf = pytest.importorskip("llguidance.hf")
    from transformers import PreTrainedTokenizerFast

    from runtime.testing.tiny_tokenizer import IM_END, train_tiny_tokenizer

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(), eos_token=IM_END)
    llg_tokenizer = llguidance_hf.from_tokenizer(tokenizer)

    def check(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(
            llg_tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar)
        )
        ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
        return bool(ok) and matcher.is_accepting() and not matcher.is_error()

    return check


def test_the_grammar_accepts_calls_valid_under_the_schemas_and_nothing_else(
    accepts: Callable[[str, str], bool],
) -> None:
    both = tool_call_grammar([WEATHER_TOOL, ADD_TOOL]).grammar
    single = tool_call_grammar([WEATHER_TOOL, ADD_TOOL], parallel=False).grammar
    named = tool_call_grammar([WEATHER_TOOL, ADD_TOOL], only="add").grammar
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>'
    assert accepts(both, WEATHER) and accepts(both, add) and accepts(both, f"{WEATHER}\n{add}")
    # The newline a model writes after a call may end the output (the EOS is allowed there).
    assert accepts(both, f"{WEATHER}\n") and not accepts(both, f"{WEATHER}\n\n")
    assert accepts(single, add) and not accepts(single, f"{WEATHER}\n{add}")
    assert accepts(named, add) and not accepts(named, WEATHER)
    assert not accepts(both, '<tool_call>\n{"name": "add", "arguments": {"a": "x"}}\n</tool_call>')
    assert not accepts(both, "Sure! " + add)
    # What the grammar lets through, the parser reads as calls.
    assert [c.name for c in parse_tool_calls(f"{WEATHER}\n{add}", NAMES)[1]] == [
        "get_weather",
        "add",
    ]


def test_a_named_function_that_is_not_a_tool_is_refused() -> None:
    with pytest.raises(ValueError, match="no tool is named 'nope'"):
        tool_call_grammar([ADD_TOOL], only="nope")
