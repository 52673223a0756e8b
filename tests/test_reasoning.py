"""Examples of the reasoning split (property_tests/test_reasoning_split.py checks it in general)."""

from __future__ import annotations

import pytest

from runtime.text.reasoning import ReasoningSplitter, Split, ends_inside_reasoning, split_reasoning


@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nplan\n</think>\n\nAnswer.", False, Split("plan", "Answer.")),
        ("plan it</think>\n\nAnswer.", True, Split("plan it", "Answer.")),
        ("  <thinking>x</thinking>y", False, Split("x", "y")),
        ("<think>cut off by max_tokens", False, Split("cut off by max_tokens", "")),
        (
            "Answer <think>not a block</think>",
            False,
            Split("", "Answer <think>not a block</think>"),
        ),
        ("  plain answer  ", False, Split("", "  plain answer  ")),
        ("<thin", False, Split("", "<thin")),
        ("a </think> b </think> c", True, Split("a", "b </think> c")),
        ("", True, Split("", "")),
    ],
)
def test_split(text: str, opened: bool, expected: Split) -> None:
    assert split_reasoning(text, opened=opened) == expected


def test_a_closing_tag_split_across_tokens_is_held_until_known() -> None:
    splitter = ReasoningSplitter(opened=True)
    assert splitter.feed("step one </th") == Split("step one", "")
    assert splitter.feed("ink>") == Split("", "")  # the blank after the tag may still come
    assert splitter.feed("\n\nYes") == Split("", "Yes")
    assert splitter.finish() == Split("", "")


def test_text_that_only_looked_like_an_opening_tag_is_content() -> None:
    splitter = ReasoningSplitter(opened=False)
    assert splitter.feed(" <thi") == Split("", "")
    assert splitter.feed("s is") == Split("", " <this is")


@pytest.mark.parametrize(
    ("prompt", "inside"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # DeepSeek-R1 / QwQ generation prompt
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking switched off
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>half a thought", True),  # a prefill inside reasoning
    ],
)
def test_prompt_that_opens_reasoning(prompt: str, inside: bool) -> None:
    assert ends_inside_reasoning(prompt) is inside
