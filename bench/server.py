"""``mlx_lm.server`` on the existing scenarios (turn2, abandon, decode), over streaming HTTP.

The server takes text prompts (it tokenizes them itself), so turn 2 is the text of turn 1, the
reply's text and the follow-up. Its own prompt cache (an LRU of KV caches) decides any reuse; the
``cached_tokens`` it reports in ``usage`` show what it reused. Started by ``bench.serving`` with its
default settings and driven by ``bench.http_client``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from bench.http_client import RequestFailed, Server, complete, open_completion
from bench.results import Measurement, decode_rate, ratio, timed
from bench.serving import ServerUnavailable, mlx_lm_server, running
from bench.workload import Workload

SYSTEM = "mlx_lm.server"
THINK_TIME_S = 0.05  # pause between turns, the same for every system


async def abandoned_then_short(server: Server, long: str, short: str, delay_s: float) -> float:
    """Send ``long``, close the connection after ``delay_s``, send ``short`` at once.

    Returns the short request's TTFT counted from the moment the long one's connection closed.
    """
    stream = await open_completion(server, long, 1)
    await asyncio.sleep(delay_s)
    stream.drop()
    left = time.perf_counter()
    return (await complete(server, short, 2, start=left)).ttft


async def _measure(server: Server, name: str, work: Workload) -> list[Measurement]:
    sizes = work.sizes
    await complete(server, work.warmup.text, 2)  # the first request also loads the model

    cold, warm, cached_cold, cached_warm = [], [], [], []
    for turn1, followup in zip(work.conversations, work.followups, strict=True):
        first = await complete(server, turn1.text, sizes.reply_tokens)
        cold.append(first.ttft)
        cached_cold.append(first.cached_tokens)
        await asyncio.sleep(THINK_TIME_S)
        second = await complete(server, turn1.text + first.text + followup.text, 1)
        warm.append(second.ttft)
        cached_warm.append(second.cached_tokens)
        prompt_tokens = second.prompt_tokens
        cold_prompt_tokens = first.prompt_tokens

    long_cold, idle, after = [], [], []
    for long, long2, s_idle, s_after in zip(
        work.longs, work.longs_abandoned, work.shorts_idle, work.shorts_after, strict=True
    ):
        long_cold.append((await complete(server, long.text, 1)).ttft)
        idle.append((await complete(server, s_idle.text, 2)).ttft)
        delay = sizes.abandon_fraction * long_cold[-1]
        after.append(await abandoned_then_short(server, long2.text, s_after.text, delay))

    rates = []
    for prompt in work.decode:
        reply = await complete(server, prompt.text, sizes.decode_tokens)
        produced = reply.completion_tokens
        first_chunk_tokens = 1  # the first chunk carries (at least) the first token
        span = reply.chunks[-1][0] - reply.chunks[0][0]
        rates.append((produced - first_chunk_tokens) / span if span > 0 else float("nan"))

    cold_m = timed(SYSTEM, name, "turn2.cold_ttft", cold)
    warm_m = timed(SYSTEM, name, "turn2.warm_ttft", warm)
    idle_m = timed(SYSTEM, name, "abandon.short_idle_ttft", idle)
    after_m = timed(SYSTEM, name, "abandon.short_after_ttft", after)
    warm_cached, cold_cached = cached_warm[-1], cached_cold[-1]
    return [
        cold_m,
        warm_m,
        ratio(SYSTEM, name, "turn2.cold/warm", cold_m.value, warm_m.value),
        Measurement(
            SYSTEM,
            name,
            "turn2.prefilled_cold",
            None if cold_cached is None else float(cold_prompt_tokens - cold_cached),
            "tokens",
        ),
        Measurement(
            SYSTEM,
            name,
            "turn2.prefilled_warm",
            None if warm_cached is None else float(prompt_tokens - warm_cached),
            "tokens",
            note=f"prompt_tokens - usage cached_tokens (turn-2 prompt {prompt_tokens} tokens, "
            f"cached {cached_warm})",
        ),
        timed(SYSTEM, name, "abandon.long_cold_ttft", long_cold),
        idle_m,
        after_m,
        ratio(SYSTEM, name, "abandon.after/idle", after_m.value, idle_m.value),
        decode_rate(
            SYSTEM, name, rates, note="usage completion_tokens over the span of streamed chunks"
        ),
    ]


def measure(model_dir: Path, name: str, work: Workload) -> list[Measurement]:
    """All server measurements for one model, or one row saying why the server was skipped."""
    try:
        with running([mlx_lm_server(model_dir)]) as [server]:
            return asyncio.run(_measure(server, name, work))
    except (ServerUnavailable, RequestFailed, OSError, TimeoutError) as exc:
        reason = f"skipped: {type(exc).__name__}: {exc}"
        return [Measurement(SYSTEM, name, "skipped", None, "-", note=reason)]
