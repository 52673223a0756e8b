"""Reasoning blocks in a model's output: ``<think>...</think>`` apart from the answer.

Models that think write their reasoning in a block before the answer, opened either by the model
or by the chat template (Qwen3- and DeepSeek-R1-style prompts end inside an open block:
``ends_inside_reasoning``). ``split_reasoning`` defines the split once; ``ReasoningSplitter``
makes the same split from text in any pieces, holding back only what may still be part of a tag,
so a stream and a whole reply always agree (property-tested). ``<thinking>`` is read as
``<think>``.

The split's rules: docs/chat.md, "Reasoning in the output".
"""

from __future__ import annotations

import enum
from typing import Final, NamedTuple

# (opening, closing) tag pairs; neither opening tag is a prefix of the other, nor closing tag.
TAGS: Final = (("<think>", "</think>"), ("<thinking>", "</thinking>"))
_OPENING: Final = tuple(opening for opening, _ in TAGS)
_CLOSING: Final = tuple(closing for _, closing in TAGS)


class Split(NamedTuple):
    """Reasoning text and answer text (either may be empty)."""

    reasoning: str
    content: str


def ends_inside_reasoning(prompt: str) -> bool:
    """Whether ``prompt`` leaves a reasoning block open: its last opening tag comes after its last
    closing tag (mlx_lm.server's test), so the model's output starts as reasoning."""
    last_open = max(prompt.rfind(tag) for tag in _OPENING)
    last_close = max(prompt.rfind(tag) for tag in _CLOSING)
    return last_open > last_close


def split_reasoning(text: str, *, opened: bool) -> Split:
    """The reasoning and the content of a whole output (module docstring); ``opened``: the prompt
    left a reasoning block open."""
    if not opened:
        body = text.lstrip()
        opening = next((tag for tag in _OPENING if body.startswith(tag)), None)
        if opening is None:
            return Split("", text)
        text = body[len(opening) :]
    found = [(at, tag) for tag in _CLOSING if (at := text.find(tag)) >= 0]
    if not found:
        return Split(text.strip(), "")
    at, closing = min(found)
    return Split(text[:at].strip(), text[at + len(closing) :].lstrip())


class _Phase(enum.Enum):
    OPENING = enum.auto()  # not yet known whether the output opens a block
    REASONING = enum.auto()
    ANSWER = enum.auto()  # after a closing tag: leading whitespace still to drop
    PLAIN = enum.auto()  # everything from here on is content, as it comes


class ReasoningSplitter:
    """Splits streamed output into reasoning and content deltas (``split_reasoning``, piecewise).

    ``feed`` each piece of text as it comes, then ``finish`` once; every call returns the
    reasoning and content it can release now.
    """

    def __init__(self, *, opened: bool) -> None:
        self._phase = _Phase.REASONING if opened else _Phase.OPENING
        self._held = ""  # text not released yet: a possible tag, or whitespace to trim
        self._reasoning_begun = False  # leading whitespace of the reasoning is behind us

    def feed(self, text: str) -> Split:
        self._held += text
        match self._phase:
            case _Phase.OPENING:
                return self._opening()
            case _Phase.REASONING:
                return self._reasoning()
            case _Phase.ANSWER:
                return Split("", self._answer())
            case _Phase.PLAIN:
                return Split("", self._release())

    def finish(self) -> Split:
        """What is still held, now that no more text comes."""
        held = self._release()
        match self._phase:
            case _Phase.OPENING | _Phase.PLAIN:
                return Split("", held)  # never opened a block: the text as it was
            case _Phase.REASONING:
                reasoning = held.rstrip()
                return Split(reasoning if self._reasoning_begun else reasoning.lstrip(), "")
            case _Phase.ANSWER:
                return Split("", held.lstrip())

    def _opening(self) -> Split:
        body = self._held.lstrip()
        if not body or any(tag.startswith(body) and tag != body for tag in _OPENING):
            return Split("", "")  # whitespace, or the start of an opening tag: wait
        opening = next((tag for tag in _OPENING if body.startswith(tag)), None)
        if opening is None:
            self._phase = _Phase.PLAIN
            return Split("", self._release())
        self._phase = _Phase.REASONING
        self._held = body[len(opening) :]
        return self._reasoning()

    def _reasoning(self) -> Split:
        if not self._reasoning_begun:
            self._held = self._held.lstrip()
            if not self._held:
                return Split("", "")
            self._reasoning_begun = True
        found = [(at, tag) for tag in _CLOSING if (at := self._held.find(tag)) >= 0]
        if found:
            at, closing = min(found)
            reasoning = self._held[:at].rstrip()
            self._held = self._held[at + len(closing) :]
            self._phase = _Phase.ANSWER
            return Split(reasoning, self._answer())
        # Release all but a possible start of a closing tag and the whitespace before it.
        keep = max(_partial_suffix(self._held, tag) for tag in _CLOSING)
        head = self._held[: len(self._held) - keep]
        released = head.rstrip()
        self._held = self._held[len(released) :]
        return Split(released, "")

    def _answer(self) -> str:
        self._held = self._held.lstrip()
        if not self._held:
            return ""
        self._phase = _Phase.PLAIN
        return self._release()

    def _release(self) -> str:
        held, self._held = self._held, ""
        return held


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
