"""Generation scenarios (``--scenarios generation``): decode speed, batching, chunking, coalescing.

All greedy, on our runtime (backend="mlx") unless the system says otherwise:

- ``gen.one.*``: one stream's decode tokens/s on the engine's B=1 fast path, against the same
  stream decoded at the backend level by the backend's own B=1 loop (``prefill`` + ``logits``) and
  by a ``DecodeBatch`` of one (same prompt, same steps: the batching overhead alone), and against
  raw mlx-lm's ``stream_generate``.
- ``gen.four.*``: aggregate tokens/s of 4 concurrent streams vs the same 4 one after another, and
  the 4 concurrent with batching off (``ModelSpec.options["batching"] = False``).
- ``gen.itl.*``: the inter-token gaps of a running stream while a long prompt is prefilled, with
  two prefill chunk sizes, against that prefill alone.
- ``gen.coalesce.*``: stream events for one reply with coalescing on vs off (same text).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from bench.generation_backend import measure_backend
from bench.generation_inputs import (
    GEN_SIZES,
    SYSTEM,
    GenPrompts,
    GenSizes,
    build_prompts,
    tok_rates,
)
from bench.results import Measurement, ratio, timed
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, Started, TokensEmitted
from runtime.text.coalesce import CoalescePolicy

__all__ = ["GEN_SIZES", "measure"]

KV_BUDGET_BYTES = 512 << 20
PER_TOKEN = CoalescePolicy(enabled=False)  # one event per token: every arrival is timed


# --------------------------------------------------------------------------- helpers


@dataclass
class Stream:
    """One request's tokens and event arrival times (seconds from ``origin``)."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stamps: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in event)
    started: Started | None = None
    mark: int = 0  # set ``marked`` once this many tokens have arrived
    marked: anyio.Event | None = None

    @property
    def events(self) -> int:
        return len(self.stamps)

    def rate(self) -> float:
        """Decode tokens/s: tokens after the first over the time from the first to the last."""
        later = sum(n for _, n in self.stamps[1:])
        span = self.stamps[-1][0] - self.stamps[0][0]
        return later / span if span > 0 else float("nan")


async def _stream(
    rt: Runtime,
    model: str,
    tokens: Sequence[int],
    max_tokens: int,
    origin: float,
    coalesce: CoalescePolicy | None = PER_TOKEN,
    into: Stream | None = None,
) -> Stream:
    run = Stream() if into is None else into
    async with rt.generate(
        model, prompt_tokens=tuple(tokens), max_tokens=max_tokens, coalesce=coalesce
    ) as stream:
        async for event in stream:
            if isinstance(event, Started):
                run.started = event
            elif isinstance(event, TokensEmitted):
                run.tokens.extend(event.token_ids)
                run.text += event.text
                run.stamps.append((time.perf_counter() - origin, len(event.token_ids)))
                if run.marked is not None and len(run.tokens) >= run.mark:
                    run.marked.set()
    return run


def _engine_counter(rt: Runtime, model: str, name: str) -> int:
    actors = rt.stats().actors
    prefix = f"engine:{model}#"
    return sum(s.counters.get(name, 0) for a, s in actors.items() if a.startswith(prefix))


# --------------------------------------------------------------------------- runtime scenarios


async def _one_stream(rt: Runtime, name: str, prompts: GenPrompts, sizes: GenSizes) -> list[float]:
    rates = []
    for prompt in prompts.one:
        await rt.reset(name)
        run = await _stream(rt, name, prompt, sizes.one_steps + 1, time.perf_counter())
        rates.append(run.rate())
    return rates


async def _four(
    rt: Runtime, name: str, prompts: Sequence[Sequence[int]], n: int, concurrent: bool
) -> tuple[float, list[list[int]]]:
    """Aggregate tokens/s of ``prompts`` (all together, or one after another) and their tokens."""
    await rt.reset(name)
    runs = [Stream() for _ in prompts]
    began = time.perf_counter()
    if concurrent:
        async with anyio.create_task_group() as tg:
            for prompt, run in zip(prompts, runs, strict=True):
                tg.start_soon(_stream, rt, name, prompt, n, began, None, run)
    else:
        for prompt, run in zip(prompts, runs, strict=True):
            await _stream(rt, name, prompt, n, began, None, run)
    elapsed = time.perf_counter() - began
    return sum(len(r.tokens) for r in runs) / elapsed, [r.tokens for r in runs]


@dataclass
class Gaps:
    before: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)


async def _interference(
    rt: Runtime, name: str, a_prompt: Sequence[int], b_prompt: Sequence[int], sizes: GenSizes
) -> tuple[Gaps, float]:
    """A's inter-token gaps before / during / after B's prefill, and B's TTFT (from its send)."""
    await rt.reset(name)
    origin = time.perf_counter()
    a = Stream(mark=sizes.itl_a_lead_tokens, marked=anyio.Event())
    b = Stream()
    b_sent = 0.0

    async def send_b() -> None:
        nonlocal b_sent
        assert a.marked is not None
        await a.marked.wait()
        b_sent = time.perf_counter() - origin
        await _stream(rt, name, b_prompt, 1, origin, into=b)

    async with anyio.create_task_group() as tg:
        tg.start_soon(_stream, rt, name, a_prompt, sizes.itl_a_tokens, origin, PER_TOKEN, a)
        tg.start_soon(send_b)
    b_first = b.stamps[0][0]
    gaps = Gaps()
    times = [t for t, _ in a.stamps]
    for start, end in itertools.pairwise(times):
        gap = end - start
        if end <= b_sent:
            gaps.before.append(gap)
        elif start < b_first:
            gaps.during.append(gap)
        else:
            gaps.after.append(gap)
    return gaps, b_first - b_sent


async def _alone_ttft(rt: Runtime, name: str, prompt: Sequence[int]) -> float:
    await rt.reset(name)
    began = time.perf_counter()
    run = await _stream(rt, name, prompt, 1, began)
    return run.stamps[0][0]


async def _coalesce(rt: Runtime, name: str, prompt: Sequence[int], n: int) -> tuple[Stream, Stream]:
    await rt.reset(name)
    on = await _stream(rt, name, prompt, n, time.perf_counter(), CoalescePolicy())
    await rt.reset(name)
    off = await _stream(rt, name, prompt, n, time.perf_counter(), PER_TOKEN)
    return on, off


def _gap_rows(name: str, label: str, gaps: Gaps, note: str) -> list[Measurement]:
    rows = []
    for phase in ("before", "during", "after"):
        values: list[float] = getattr(gaps, phase)
        med = timed(SYSTEM, name, f"gen.itl.{label}.{phase}.median_gap", values)
        rows.append(Measurement(SYSTEM, name, med.scenario, med.value, "ms", note=note))
        top = round(max(values) * 1000, 3) if values else None
        rows.append(Measurement(SYSTEM, name, f"gen.itl.{label}.{phase}.max_gap", top, "ms"))
        note = ""
    return rows


async def _measure_runtime(
    path: Path, name: str, prompts: GenPrompts, sizes: GenSizes
) -> list[Measurement]:
    nobatch = f"{name}-nobatch"
    chunked = {chunk: f"{name}-chunk{chunk}" for chunk in sizes.itl_chunks}
    async with Runtime(RuntimeConfig(kv_budget_bytes=KV_BUDGET_BYTES)) as rt:
        await rt.load_model(ModelSpec(name=name, backend="mlx", path=str(path)))
        await rt.load_model(
            ModelSpec(name=nobatch, backend="mlx", path=str(path), options={"batching": False})
        )
        for chunk, model in chunked.items():
            await rt.load_model(
                ModelSpec(name=model, backend="mlx", path=str(path), prefill_chunk_tokens=chunk)
            )
        for model in (name, nobatch, *chunked.values()):
            await _stream(rt, model, prompts.warmup, 4, time.perf_counter())

        # 1. one stream on the fast path
        fast = await _one_stream(rt, name, prompts, sizes)
        fast_steps = _engine_counter(rt, name, "batch_steps")

        # 2. four streams: concurrent (batched), one after another, concurrent without batching
        n = sizes.four_tokens
        conc, seq, flat = [], [], []
        same = True
        steps_before = _engine_counter(rt, name, "batch_steps")
        batched_before = _engine_counter(rt, name, "batched_tokens")
        for four in prompts.four:
            rate_c, tokens_c = await _four(rt, name, four, n, concurrent=True)
            rate_s, tokens_s = await _four(rt, name, four, n, concurrent=False)
            rate_f, tokens_f = await _four(rt, nobatch, four, n, concurrent=True)
            conc.append(rate_c)
            seq.append(rate_s)
            flat.append(rate_f)
            same &= tokens_c == tokens_s == tokens_f
        batch_steps = _engine_counter(rt, name, "batch_steps") - steps_before
        batched = _engine_counter(rt, name, "batched_tokens") - batched_before
        nobatch_steps = _engine_counter(rt, nobatch, "batch_steps")

        # 3. inter-token latency of A while B's long prompt is prefilled, per chunk size
        itl: dict[int, tuple[Gaps, list[float], list[float]]] = {}
        for chunk, model in chunked.items():
            merged, ttfts, alone = Gaps(), [], []
            for a_prompt, b_prompt in zip(prompts.itl_a, prompts.itl_b, strict=True):
                gaps, ttft = await _interference(rt, model, a_prompt, b_prompt, sizes)
                merged.before += gaps.before
                merged.during += gaps.during
                merged.after += gaps.after
                ttfts.append(ttft)
                alone.append(await _alone_ttft(rt, model, b_prompt))
            itl[chunk] = (merged, ttfts, alone)

        # 4. stream events with coalescing on vs off
        on, off = await _coalesce(rt, name, prompts.coalesce, sizes.coalesce_tokens)

    rows = [
        tok_rates(SYSTEM, name, "gen.one.tok_s", fast),
        Measurement(
            SYSTEM,
            name,
            "gen.one.engine_batch_steps",
            float(fast_steps),
            "count",
            note="one stream alone stays on the B=1 fast path (batch_steps stays 0)",
        ),
    ]
    four_conc = tok_rates(SYSTEM, name, "gen.four.concurrent_tok_s", conc)
    four_seq = tok_rates(SYSTEM, name, "gen.four.sequential_tok_s", seq)
    four_flat = tok_rates(SYSTEM, name, "gen.four.concurrent_nobatch_tok_s", flat)
    rows += [
        four_conc,
        four_seq,
        four_flat,
        ratio(SYSTEM, name, "gen.four.concurrent/sequential", four_conc.value, four_seq.value),
        ratio(SYSTEM, name, "gen.four.concurrent/nobatch", four_conc.value, four_flat.value),
        Measurement(
            SYSTEM,
            name,
            "gen.four.batch_steps",
            float(batch_steps),
            "count",
            note=f"4 x {len(prompts.four[0][0])}-token prompts, {n} tokens each, "
            f"{sizes.repetitions} rep(s); batched_tokens {batched}, batch_steps with "
            f"batching off {nobatch_steps}; same greedy tokens in all three modes: {same}",
        ),
    ]
    for chunk, (gaps, ttfts, alone) in itl.items():
        ttft_m = timed(SYSTEM, name, f"gen.itl.chunk{chunk}.b_ttft_with_a", ttfts)
        alone_m = timed(SYSTEM, name, f"gen.itl.chunk{chunk}.b_prefill_alone", alone)
        note = (
            f"A: {sizes.itl_a_tokens} tokens, per-token events; B ({len(prompts.itl_b[0])}-token "
            f"prompt) sent after A's {sizes.itl_a_lead_tokens}th token; prefill_chunk_tokens "
            f"{chunk}; gaps of {sizes.repetitions} rep(s) pooled"
        )
        rows += _gap_rows(name, f"chunk{chunk}", gaps, note)
        rows += [ttft_m, alone_m]
    texts_equal = on.text == off.text and on.tokens == off.tokens
    rows += [
        Measurement(SYSTEM, name, "gen.coalesce.events_on", float(on.events), "count"),
        Measurement(
            SYSTEM,
            name,
            "gen.coalesce.events_off",
            float(off.events),
            "count",
            note=f"{sizes.coalesce_tokens}-token reply, default CoalescePolicy() vs "
            f"enabled=False; same text and tokens: {texts_equal}",
        ),
    ]
    return rows


def measure(
    path: Path, model: Any, tokenizer: Any, name: str, sizes: GenSizes
) -> list[Measurement]:
    """Every generation scenario for one model: backend level first, then the runtime."""
    prompts = build_prompts(tokenizer, sizes)
    rows = measure_backend(path, model, tokenizer, name, prompts, sizes)
    runtime_rows = asyncio.run(_measure_runtime(path, name, prompts, sizes))
    rows += runtime_rows
    fast = next((r for r in runtime_rows if r.scenario == "gen.one.tok_s"), None)
    raw = next((r for r in rows if r.scenario == "gen.one.tok_s" and r.system == "mlx-lm"), None)
    b1 = next((r for r in rows if r.scenario == "gen.one.backend_b1_tok_s"), None)
    if fast is not None and raw is not None:
        rows.append(ratio(SYSTEM, name, "gen.one.runtime/mlx-lm", fast.value, raw.value))
    if fast is not None and b1 is not None:
        rows.append(ratio(SYSTEM, name, "gen.one.runtime/backend_b1", fast.value, b1.value))
    return rows
