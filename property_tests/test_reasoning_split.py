"""The streamed reasoning split is the whole-output split, however the text arrives.

Texts are built from pieces of the tags (whole, cut in two), whitespace and plain characters, so
tags straddle chunk boundaries, almost-tags occur and whitespace sits around them; they are cut at
random points as a tokenizer would. Settings come from the active Hypothesis profile.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from runtime.text.reasoning import ReasoningSplitter, Split, split_reasoning

TAG_PIECES = ["<think>", "</think>", "<thinking>", "</thinking>", "<thi", "nk>", "</th", "ing>"]
PIECES = st.sampled_from([*TAG_PIECES, " ", "\n", "a", "b", "\u00e9", "<", ">", "/"])
PLAIN = st.text(alphabet="ab \n\u00e9<>/", max_size=12).filter(lambda s: "think" not in s)


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[start:end] for start, end in itertools.pairwise(bounds)]


def streamed(pieces: list[str], *, opened: bool) -> Split:
    splitter = ReasoningSplitter(opened=opened)
    reasoning: list[str] = []
    content: list[str] = []
    for part in [*(splitter.feed(piece) for piece in pieces), splitter.finish()]:
        reasoning.append(part.reasoning)
        content.append(part.content)
    return Split("".join(reasoning), "".join(content))


@given(
    text=st.lists(PIECES, max_size=30).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=200)),
    opened=st.booleans(),
)
def test_any_chunking_streams_the_whole_split(text: str, cuts: list[int], opened: bool) -> None:
    assert streamed(split_at(text, cuts), opened=opened) == split_reasoning(text, opened=opened)


@given(
    text=st.lists(PIECES, max_size=30).map("".join),
    cuts=st.lists(st.integers(min_value=0, max_value=200)),
    opened=st.booleans(),
)
def test_reasoning_is_released_before_any_content(text: str, cuts: list[int], opened: bool) -> None:
    splitter = ReasoningSplitter(opened=opened)
    content_seen = False
    for piece in split_at(text, cuts):
        part = splitter.feed(piece)
        assert not (content_seen and part.reasoning)
        content_seen = content_seen or bool(part.content)
    assert not (content_seen and splitter.finish().reasoning)


@given(reasoning=PLAIN, answer=PLAIN, lead=st.sampled_from(["", " ", "\n\n"]), opened=st.booleans())
def test_a_think_block_splits_into_its_parts(
    reasoning: str, answer: str, lead: str, opened: bool
) -> None:
    opening = "" if opened else f"{lead}<think>"
    whole = split_reasoning(f"{opening}{reasoning}</think>{answer}", opened=opened)
    assert whole == Split(reasoning.strip(), answer.lstrip())


@given(text=PLAIN.filter(lambda s: not s.lstrip().startswith("<")))
def test_output_without_a_block_is_content_untouched(text: str) -> None:
    assert split_reasoning(text, opened=False) == Split("", text)
    assert streamed(list(text), opened=False) == Split("", text)
