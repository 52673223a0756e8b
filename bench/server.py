"""A server on the existing scenarios (turn2, abandon, decode), over streaming HTTP, one at a time.

``mlx_lm.server``, ``llama-server`` and ``mlxrt serve --backend llamacpp`` (bench/llamacpp.py).
They take text prompts (each tokenizes them itself), so turn 2 is the text of turn 1, the reply's
text and the follow-up. A server's own prompt cache decides any reuse; what it reports
(``cached_tokens`` in ``usage``, llama-server's ``timings.prompt_n``) shows what it computed.
Started by ``bench.serving`` with its default settings and driven by ``bench.http_client``.
"""

from __future__ import annotations

import asyncio
import time

from bench.http_client import RequestFailed, Server, complete, open_completion
from bench.results import Measurement, decode_rate, ratio, split_ttft, timed
from bench.serving import ServerCommand, ServerUnavailable, running
from bench.workload import Workload

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
    system, sizes = server.system, work.sizes
    await complete(server, work.warmup.text, 2)  # the first request also loads the model

    cold, warm, prefilled_cold, prefilled_warm = [], [], [], []
    cold_eval: list[float | None] = []
    warm_eval: list[float | None] = []
    for turn1, followup in zip(work.conversations, work.followups, strict=True):
        first = await complete(server, turn1.text, sizes.reply_tokens)
        cold.append(first.ttft)
        cold_eval.append(first.prompt_eval_s)
        prefilled_cold.append(first.prefilled_tokens)
        await asyncio.sleep(THINK_TIME_S)
        second = await complete(server, turn1.text + first.text + followup.text, 1)
        warm.append(second.ttft)
        warm_eval.append(second.prompt_eval_s)
        prefilled_warm.append(second.prefilled_tokens)
        prompt_tokens = second.prompt_tokens

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

    cold_m = timed(system, name, "turn2.cold_ttft", cold)
    warm_m = timed(system, name, "turn2.warm_ttft", warm)
    idle_m = timed(system, name, "abandon.short_idle_ttft", idle)
    after_m = timed(system, name, "abandon.short_after_ttft", after)
    warm_prefilled, cold_prefilled = prefilled_warm[-1], prefilled_cold[-1]
    how = (
        "llama-server's timings.prompt_n"
        if system == "llama-server"
        else "prompt_tokens - usage cached_tokens"
    )
    return [
        cold_m,
        *split_ttft(system, name, "turn2.cold_ttft", cold, cold_eval),
        warm_m,
        *split_ttft(system, name, "turn2.warm_ttft", warm, warm_eval),
        ratio(system, name, "turn2.cold/warm", cold_m.value, warm_m.value),
        Measurement(
            system,
            name,
            "turn2.prefilled_cold",
            None if cold_prefilled is None else float(cold_prefilled),
            "tokens",
        ),
        Measurement(
            system,
            name,
            "turn2.prefilled_warm",
            None if warm_prefilled is None else float(warm_prefilled),
            "tokens",
            note=f"{how} (turn-2 prompt {prompt_tokens} tokens, prefilled {prefilled_warm})",
        ),
        timed(system, name, "abandon.long_cold_ttft", long_cold),
        idle_m,
        after_m,
        ratio(system, name, "abandon.after/idle", after_m.value, idle_m.value),
        decode_rate(
            system, name, rates, note="usage completion_tokens over the span of streamed chunks"
        ),
    ]


def measure(command: ServerCommand, name: str, work: Workload) -> list[Measurement]:
    """All measurements of the server ``command`` starts on one model, or one row saying why it
    was skipped."""
    try:
        with running([command]) as [server]:
            return asyncio.run(_measure(server, name, work))
    except (ServerUnavailable, RequestFailed, OSError, TimeoutError) as exc:
        reason = f"skipped: {type(exc).__name__}: {exc}"
        return [Measurement(command.system, name, "skipped", None, "-", note=reason)]
