"""Concurrent streams (``--scenarios concurrency``): N clients at once, over HTTP.

N streamed greedy ``/v1/completions`` (distinct prompts of the same size, the same ``max_tokens``)
are sent together to one server, for N = 1, 2, 4, 8. Both servers batch concurrent requests:
``mlx_lm.server`` 0.32 runs a ``BatchGenerator`` on its one generation thread (up to 32 decoding
and 8 prefilling at once by default); ours decodes them in one ``DecodeBatch`` (up to 8 rows).

- ``concurrency.N.tok_s``: completion tokens of all N over the time from the first send to the
  last token.
- ``concurrency.N.ttft_p50`` / ``concurrency.N.ttft_max``: the streams' median and slowest TTFT,
  each from its own send (ms).

Each value is the median over repetitions; samples are the per-repetition values.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bench.http_client import Reply, Server, complete, in_turn, speaks_our_api
from bench.models import BenchModel, Scaled
from bench.prompts import make_text
from bench.results import Measurement, median

LEVELS = (1, 2, 4, 8)


@dataclass(frozen=True)
class ConcurrencySizes:
    prompt_tokens: int = 64
    max_tokens: int = 64
    repetitions: int = 5


SIZES = Scaled(
    tiny=ConcurrencySizes(),
    tiny_quick=ConcurrencySizes(repetitions=1),
    real=ConcurrencySizes(max_tokens=32, repetitions=3),
    real_quick=ConcurrencySizes(prompt_tokens=16, max_tokens=4, repetitions=1),
)


@dataclass
class Level:
    """One system's samples at one N, one value per repetition."""

    tok_s: list[float]
    ttft_p50: list[float]
    ttft_max: list[float]


async def _together(server: Server, prompts: Sequence[str], max_tokens: int) -> list[Reply]:
    began = time.perf_counter()
    return await asyncio.gather(
        *(complete(server, prompt, max_tokens, start=began) for prompt in prompts)
    )


async def measure(servers: Sequence[Server], model: BenchModel, quick: bool) -> list[Measurement]:
    """Every level on every server, the servers taking turns to go first."""
    sizes = SIZES.pick(model, quick)
    results = {(s.system, n): Level([], [], []) for s in servers for n in LEVELS}
    for n in LEVELS:
        for rep in range(sizes.repetitions):
            seeds = range(20000 + 100 * n + 10 * rep, 20000 + 100 * n + 10 * rep + n)
            prompts = [make_text(model.tokenizer, sizes.prompt_tokens, seed) for seed in seeds]
            for server in in_turn(servers, rep):
                replies = await _together(server, prompts, sizes.max_tokens)
                level = results[(server.system, n)]
                tokens = sum(r.completion_tokens for r in replies)
                last = max(r.last_token_s for r in replies)
                ttfts = [r.ttft * 1000 for r in replies]
                level.tok_s.append(round(tokens / last, 1))
                level.ttft_p50.append(round(statistics.median(ttfts), 3))
                level.ttft_max.append(round(max(ttfts), 3))
    rows = []
    for (system, n), level in results.items():
        note = ""
        if n == LEVELS[0]:
            how = "over HTTP (mlxrt serve); " if speaks_our_api(system) else ""
            note = (
                f"{how}N streamed completions sent together, {sizes.prompt_tokens}-token "
                f"prompts, max_tokens {sizes.max_tokens}, median of {sizes.repetitions}"
            )
        for what, samples, unit in (
            ("tok_s", level.tok_s, "tok/s"),
            ("ttft_p50", level.ttft_p50, "ms"),
            ("ttft_max", level.ttft_max, "ms"),
        ):
            scenario = f"concurrency.{n}.{what}"
            value = _rounded_median(samples)
            rows.append(Measurement(system, model.name, scenario, value, unit, samples, note))
            note = ""  # once per system and model
    return rows


def _rounded_median(values: Sequence[float]) -> float | None:
    """The median, rounded like the samples (an even count averages two of them)."""
    value = median(values)
    return None if value is None else round(value, 3)
