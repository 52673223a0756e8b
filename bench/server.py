"""The servers on the existing scenarios (turn2, abandon, decode), over streaming HTTP, in turns.

``mlx_lm.server``, ``llama-server`` and ``mlxrt serve --backend llamacpp`` (bench/llamacpp.py).
They take text prompts (each tokenizes them itself), so turn 2 is the text of turn 1, the reply's
text and the follow-up. A server's own prompt cache decides any reuse; what it reports
(``cached_tokens`` in ``usage``, llama-server's ``timings.prompt_n``) shows what it computed.
Started by ``bench.serving`` with its default settings and driven by ``bench.http_client``.

All of a model's servers run at once and take turns: each repetition of each scenario goes to
every server before the next begins, the first reversed every other time (``in_turn``), as the
HTTP groups do (bench/over_http.py). An idle server waits on its socket, so no two compute at
once, and a ratio compares requests a few seconds apart rather than one server's minutes with
the other's later ones: on this shared CPU the load drifts over minutes (the same 400-token cold
prefill of SmolLM2 took 1.14 s in one run and 1.45 s in another). After an abandon, the short
request returns only once the server is done with the abandoned prompt, so the next server starts
on a quiet CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.http_client import RequestFailed, Server, complete, in_turn, open_completion
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


@dataclass
class _Samples:
    """What one server measured, repetition by repetition."""

    cold: list[float] = field(default_factory=list)
    cold_eval: list[float | None] = field(default_factory=list)
    warm: list[float] = field(default_factory=list)
    warm_eval: list[float | None] = field(default_factory=list)
    prefilled_cold: list[int | None] = field(default_factory=list)
    prefilled_warm: list[int | None] = field(default_factory=list)
    prompt_tokens: int = 0  # turn 2's, as the server counted it
    long_cold: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)


async def _measure(servers: Sequence[Server], name: str, work: Workload) -> list[Measurement]:
    sizes = work.sizes
    for server in servers:  # the first request also loads the model
        await complete(server, work.warmup.text, 2)
    samples = {server.system: _Samples() for server in servers}

    for rep, (turn1, followup) in enumerate(zip(work.conversations, work.followups, strict=True)):
        for server in in_turn(servers, rep):
            into = samples[server.system]
            first = await complete(server, turn1.text, sizes.reply_tokens)
            into.cold.append(first.ttft)
            into.cold_eval.append(first.prompt_eval_s)
            into.prefilled_cold.append(first.prefilled_tokens)
            await asyncio.sleep(THINK_TIME_S)
            second = await complete(server, turn1.text + first.text + followup.text, 1)
            into.warm.append(second.ttft)
            into.warm_eval.append(second.prompt_eval_s)
            into.prefilled_warm.append(second.prefilled_tokens)
            into.prompt_tokens = second.prompt_tokens

    abandons = zip(
        work.longs, work.longs_abandoned, work.shorts_idle, work.shorts_after, strict=True
    )
    for rep, (long, long2, s_idle, s_after) in enumerate(abandons):
        for server in in_turn(servers, rep):
            into = samples[server.system]
            into.long_cold.append((await complete(server, long.text, 1)).ttft)
            into.idle.append((await complete(server, s_idle.text, 2)).ttft)
            delay = sizes.abandon_fraction * into.long_cold[-1]
            into.after.append(await abandoned_then_short(server, long2.text, s_after.text, delay))

    for rep, prompt in enumerate(work.decode):
        for server in in_turn(servers, rep):
            reply = await complete(server, prompt.text, sizes.decode_tokens)
            first_chunk_tokens = 1  # the first chunk carries (at least) the first token
            span = reply.chunks[-1][0] - reply.chunks[0][0]
            produced = reply.completion_tokens - first_chunk_tokens
            samples[server.system].rates.append(produced / span if span > 0 else float("nan"))

    return [row for server in servers for row in _rows(server.system, name, samples[server.system])]


def _rows(system: str, name: str, got: _Samples) -> list[Measurement]:
    cold_m = timed(system, name, "turn2.cold_ttft", got.cold)
    warm_m = timed(system, name, "turn2.warm_ttft", got.warm)
    idle_m = timed(system, name, "abandon.short_idle_ttft", got.idle)
    after_m = timed(system, name, "abandon.short_after_ttft", got.after)
    warm_prefilled, cold_prefilled = got.prefilled_warm[-1], got.prefilled_cold[-1]
    how = (
        "llama-server's timings.prompt_n"
        if system == "llama-server"
        else "prompt_tokens - usage cached_tokens"
    )
    return [
        cold_m,
        *split_ttft(system, name, "turn2.cold_ttft", got.cold, got.cold_eval),
        warm_m,
        *split_ttft(system, name, "turn2.warm_ttft", got.warm, got.warm_eval),
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
            note=(
                f"{how} (turn-2 prompt {got.prompt_tokens} tokens, prefilled {got.prefilled_warm})"
            ),
        ),
        timed(system, name, "abandon.long_cold_ttft", got.long_cold),
        idle_m,
        after_m,
        ratio(system, name, "abandon.after/idle", after_m.value, idle_m.value),
        decode_rate(
            system, name, got.rates, note="usage completion_tokens over the span of streamed chunks"
        ),
    ]


def measure(commands: Sequence[ServerCommand], name: str, work: Workload) -> list[Measurement]:
    """All measurements of the servers ``commands`` start on one model, taking turns (module
    docstring), or a row per server saying why none could be measured."""
    if not commands:
        return []
    try:
        with running(commands) as servers:
            return asyncio.run(_measure(servers, name, work))
    except (ServerUnavailable, RequestFailed, OSError, TimeoutError) as exc:
        reason = f"skipped: {type(exc).__name__}: {exc}"
        return [
            Measurement(command.system, name, "skipped", None, "-", note=reason)
            for command in commands
        ]
