"""Raw mlx-lm, the way a person rolling their own would: ``generate_step`` + one prompt cache.

Turn 2 keeps the conversation's cache and feeds only the tokens it has not seen. There is no
abandon measurement: ``generate_step`` prefills before its first yield, so a hand-rolled loop
has no point at which to stop a prefill (the caller waits for all of it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench.results import Measurement, decode_rate, ratio, timed
from bench.workload import Workload

SYSTEM = "mlx-lm"
THINK_TIME_S = 0.05  # pause between turns, the same for every system


def _run(
    model: Any, tokens: Sequence[int], cache: list[Any], max_tokens: int
) -> tuple[list[int], list[float]]:
    """Generated tokens and the time (from the call) each one arrived."""
    start = time.perf_counter()
    out: list[int] = []
    stamps: list[float] = []
    prompt = mx.array(list(tokens))
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens, prompt_cache=cache):
        out.append(int(token))
        stamps.append(time.perf_counter() - start)
    return out, stamps


def _cached_tokens(cache: list[Any]) -> int:
    """Tokens the cache has seen (attention layers know; recurrent layers have no offset)."""
    return max((int(layer.offset) for layer in cache if hasattr(layer, "offset")), default=0)


def measure(model: Any, name: str, work: Workload) -> list[Measurement]:
    sizes = work.sizes
    _run(model, work.warmup.tokens, make_prompt_cache(model), 2)

    cold, warm, fed_cold, fed_warm = [], [], [], []
    for turn1, followup in zip(work.conversations, work.followups, strict=True):
        cache = make_prompt_cache(model)
        reply, stamps = _run(model, turn1.tokens, cache, sizes.reply_tokens)
        cold.append(stamps[0])
        fed_cold.append(len(turn1.tokens))
        time.sleep(THINK_TIME_S)
        turn2 = [*turn1.tokens, *reply, *followup.tokens]
        seen = _cached_tokens(cache)
        _, stamps = _run(model, turn2[seen:], cache, 1)
        warm.append(stamps[0])
        fed_warm.append(len(turn2) - seen)

    rates = []
    for prompt in work.decode:
        tokens, stamps = _run(model, prompt.tokens, make_prompt_cache(model), sizes.decode_tokens)
        rates.append((len(tokens) - 1) / (stamps[-1] - stamps[0]))

    cold_m = timed(SYSTEM, name, "turn2.cold_ttft", cold)
    warm_m = timed(SYSTEM, name, "turn2.warm_ttft", warm)
    return [
        cold_m,
        warm_m,
        ratio(SYSTEM, name, "turn2.cold/warm", cold_m.value, warm_m.value),
        Measurement(SYSTEM, name, "turn2.prefilled_cold", float(fed_cold[-1]), "tokens"),
        Measurement(SYSTEM, name, "turn2.prefilled_warm", float(fed_warm[-1]), "tokens"),
        Measurement(
            SYSTEM,
            name,
            "abandon.after/idle",
            None,
            "x",
            note="not measured: generate_step prefills before its first yield, so a "
            "hand-rolled loop cannot abandon a prefill",
        ),
        decode_rate(SYSTEM, name, rates),
    ]
