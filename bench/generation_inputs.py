"""The generation scenarios' inputs (``--scenarios generation``): sizes per model kind, the
prompts every system gets, and how a list of rates becomes one measurement."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.models import Scaled
from bench.prompts import encode, make_text
from bench.results import Measurement, median

SYSTEM = "runtime"


@dataclass(frozen=True)
class GenSizes:
    """Token targets and repetitions of the generation scenarios (``--quick`` shrinks them)."""

    repetitions: int = 5
    one_prompt_tokens: int = 32
    one_steps: int = 128
    four_prompt_tokens: int = 64
    four_tokens: int = 64
    itl_a_prompt_tokens: int = 32
    itl_a_tokens: int = 200
    itl_a_lead_tokens: int = 20  # A's tokens before B is sent
    itl_b_prompt_tokens: int = 1000
    itl_chunks: tuple[int, ...] = (64, 512)
    coalesce_tokens: int = 200


GEN_SIZES = Scaled(
    tiny=GenSizes(),
    tiny_quick=GenSizes(repetitions=1),
    real=GenSizes(
        repetitions=3,
        one_steps=32,
        four_tokens=16,
        itl_a_tokens=60,
        itl_a_lead_tokens=10,
        itl_b_prompt_tokens=400,
        coalesce_tokens=48,
    ),
    real_quick=GenSizes(
        repetitions=1,
        one_steps=4,
        four_prompt_tokens=16,
        four_tokens=4,
        itl_a_prompt_tokens=16,
        itl_a_tokens=12,
        itl_a_lead_tokens=2,
        itl_b_prompt_tokens=96,
        coalesce_tokens=8,
    ),
)


@dataclass(frozen=True)
class GenPrompts:
    one: list[list[int]]  # per repetition
    four: list[list[list[int]]]  # per repetition, 4 prompts
    itl_a: list[list[int]]
    itl_b: list[list[int]]
    coalesce: list[int]
    warmup: list[int]


def build_prompts(tokenizer: Any, sizes: GenSizes) -> GenPrompts:
    def make(target: int, seed: int) -> list[int]:
        return encode(tokenizer, make_text(tokenizer, target, seed))

    reps = range(sizes.repetitions)
    return GenPrompts(
        one=[make(sizes.one_prompt_tokens, 11000 + i) for i in reps],
        four=[[make(sizes.four_prompt_tokens, 12000 + 10 * i + j) for j in range(4)] for i in reps],
        itl_a=[make(sizes.itl_a_prompt_tokens, 13000 + i) for i in reps],
        itl_b=[make(sizes.itl_b_prompt_tokens, 14000 + i) for i in reps],
        coalesce=make(sizes.four_prompt_tokens, 15000),
        warmup=make(16, 16000),
    )


def tok_rates(system: str, model: str, scenario: str, samples: Sequence[float]) -> Measurement:
    rounded = [round(r, 1) for r in samples]
    return Measurement(system, model, scenario, median(rounded), "tok/s", rounded)
