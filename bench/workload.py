"""The prompts every system gets, built once per model so all three see the same input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.models import Scaled
from bench.prompts import encode, make_text


@dataclass(frozen=True)
class Sizes:
    """Token targets and repetition counts (``--quick`` shrinks them)."""

    conversation_tokens: int = 600
    reply_tokens: int = 8
    followup_tokens: int = 12
    long_tokens: int = 1500
    short_tokens: int = 16
    decode_prompt_tokens: int = 32
    decode_tokens: int = 64
    repetitions: int = 5
    # Abandon the long prefill after this fraction of its measured cold TTFT.
    abandon_fraction: float = 0.2


SIZES = Scaled(
    tiny=Sizes(),
    tiny_quick=Sizes(conversation_tokens=300, long_tokens=800, repetitions=1),
    real=Sizes(conversation_tokens=400, long_tokens=1000, decode_tokens=32, repetitions=3),
    real_quick=Sizes(conversation_tokens=64, long_tokens=200, decode_tokens=8, repetitions=1),
)


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Workload:
    """Distinct prompts per repetition, so no repetition hits a cache left by another."""

    sizes: Sizes
    conversations: list[Prompt]  # turn 1 of each repetition
    followups: list[Prompt]  # the short user message (after a newline) that turn 2 appends
    longs: list[Prompt]  # the long prompt, prefilled to its end once (its cold TTFT)
    longs_abandoned: list[Prompt]  # same size, other words: the prefill that gets abandoned
    shorts_idle: list[Prompt]  # the short request on an idle system
    shorts_after: list[Prompt]  # the same-size short request right after an abandon
    decode: list[Prompt]
    warmup: Prompt


def build_workload(tokenizer: Any, sizes: Sizes) -> Workload:
    def prompts(target: int, base_seed: int, lead: str = "") -> list[Prompt]:
        out = []
        for i in range(sizes.repetitions):
            text = lead + make_text(tokenizer, target, base_seed + i)
            out.append(Prompt(text, tuple(encode(tokenizer, text))))
        return out

    return Workload(
        sizes=sizes,
        conversations=prompts(sizes.conversation_tokens, 1000),
        followups=prompts(sizes.followup_tokens, 2000, lead="\n"),
        longs=prompts(sizes.long_tokens, 3000),
        longs_abandoned=prompts(sizes.long_tokens, 3500),
        shorts_idle=prompts(sizes.short_tokens, 4000),
        shorts_after=prompts(sizes.short_tokens, 5000),
        decode=prompts(sizes.decode_prompt_tokens, 6000),
        warmup=prompts(sizes.short_tokens, 7000)[0],
    )
