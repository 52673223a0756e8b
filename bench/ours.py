"""Our runtime (backend="mlx"): streams through ``Runtime.generate``, counters from ``stats``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.results import Measurement, decode_rate, ratio, timed
from bench.workload import Workload
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Cancelled, ModelSpec, Started, TokensEmitted

SYSTEM = "runtime"
THINK_TIME_S = 0.05  # pause between turns, the same for every system
KV_BUDGET_BYTES = 512 << 20


@dataclass
class Run:
    """What one request produced, with times measured from its submission."""

    tokens: list[int] = field(default_factory=list)
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in event)
    started: Started | None = None
    cancelled: bool = False

    @property
    def ttft(self) -> float:
        return self.stamps[0][0]


def _engine_counter(rt: Runtime, name: str) -> int:
    actors = rt.stats().actors
    return sum(s.counters.get(name, 0) for a, s in actors.items() if a.startswith("engine:"))


async def _run(
    rt: Runtime, model: str, tokens: Sequence[int], max_tokens: int, start: float | None = None
) -> Run:
    """Run one request to its end; times count from ``start`` (default: now)."""
    run = Run()
    start = time.perf_counter() if start is None else start
    async with rt.generate(model, prompt_tokens=tuple(tokens), max_tokens=max_tokens) as stream:
        async for event in stream:
            if isinstance(event, Started):
                run.started = event
            elif isinstance(event, TokensEmitted):
                run.tokens.extend(event.token_ids)
                run.stamps.append((time.perf_counter() - start, len(event.token_ids)))
            elif isinstance(event, Cancelled):
                run.cancelled = True
    return run


async def _abandoned_then_short(
    rt: Runtime, model: str, long: Sequence[int], short: Sequence[int], delay_s: float
) -> float:
    """Start ``long``, leave it after ``delay_s``, send ``short`` at once.

    Returns the short request's TTFT counted from the moment the long one was left.
    """
    stream = rt.generate(model, prompt_tokens=tuple(long), max_tokens=1)
    await stream.__aenter__()
    await asyncio.sleep(delay_s)
    left = time.perf_counter()
    # Leaving the block (aclose) cancels it; the host does not wait for that before sending more.
    closing = asyncio.create_task(stream.aclose())
    run = await _run(rt, model, short, 2, start=left)
    await closing
    return run.ttft


async def _measure(path: Path, name: str, work: Workload) -> list[Measurement]:
    sizes = work.sizes
    async with Runtime(RuntimeConfig(kv_budget_bytes=KV_BUDGET_BYTES)) as rt:
        loaded = await rt.load_model(ModelSpec(name=name, backend="mlx", path=str(path)))
        await _run(rt, name, work.warmup.tokens, 2)

        cold, warm, pre_cold, pre_warm, paths = [], [], [], [], []
        for turn1, followup in zip(work.conversations, work.followups, strict=True):
            await rt.reset(name)
            before = _engine_counter(rt, "prefilled_tokens")
            first = await _run(rt, name, turn1.tokens, sizes.reply_tokens)
            middle = _engine_counter(rt, "prefilled_tokens")
            cold.append(first.ttft)
            pre_cold.append(middle - before)
            await asyncio.sleep(THINK_TIME_S)
            second = await _run(rt, name, [*turn1.tokens, *first.tokens, *followup.tokens], 1)
            warm.append(second.ttft)
            pre_warm.append(_engine_counter(rt, "prefilled_tokens") - middle)
            if second.started is not None:
                paths.append(f"{second.started.path}:{second.started.cached_tokens}")

        long_cold, idle, after = [], [], []
        for long, long2, s_idle, s_after in zip(
            work.longs, work.longs_abandoned, work.shorts_idle, work.shorts_after, strict=True
        ):
            await rt.reset(name)
            long_cold.append((await _run(rt, name, long.tokens, 1)).ttft)
            idle.append((await _run(rt, name, s_idle.tokens, 2)).ttft)
            await rt.reset(name)
            delay = sizes.abandon_fraction * long_cold[-1]
            after.append(await _abandoned_then_short(rt, name, long2.tokens, s_after.tokens, delay))
        cancelled = _engine_counter(rt, "cancelled")

        rates = []
        for prompt in work.decode:
            run = await _run(rt, name, prompt.tokens, sizes.decode_tokens)
            later = sum(n for _, n in run.stamps[1:])
            rates.append(later / (run.stamps[-1][0] - run.stamps[0][0]))

    cold_m = timed(SYSTEM, name, "turn2.cold_ttft", cold)
    warm_m = timed(SYSTEM, name, "turn2.warm_ttft", warm)
    idle_m = timed(SYSTEM, name, "abandon.short_idle_ttft", idle)
    after_m = timed(SYSTEM, name, "abandon.short_after_ttft", after)
    return [
        cold_m,
        warm_m,
        ratio(SYSTEM, name, "turn2.cold/warm", cold_m.value, warm_m.value),
        Measurement(SYSTEM, name, "turn2.prefilled_cold", float(pre_cold[-1]), "tokens"),
        Measurement(
            SYSTEM,
            name,
            "turn2.prefilled_warm",
            float(pre_warm[-1]),
            "tokens",
            note=f"engine prefilled_tokens counter; reuse {loaded.reuse_path}, "
            f"turn-2 Started path:cached = {', '.join(paths)}",
        ),
        timed(SYSTEM, name, "abandon.long_cold_ttft", long_cold),
        idle_m,
        after_m,
        ratio(SYSTEM, name, "abandon.after/idle", after_m.value, idle_m.value),
        Measurement(
            SYSTEM,
            name,
            "abandon.cancelled_requests",
            float(cancelled),
            "count",
            note=f"abandoned {sizes.abandon_fraction:.0%} into the long prompt's cold TTFT",
        ),
        decode_rate(SYSTEM, name, rates),
    ]


def measure(path: Path, name: str, work: Workload) -> list[Measurement]:
    return asyncio.run(_measure(path, name, work))
