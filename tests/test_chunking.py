"""Prefill chunks sized by time: the sizer on given measurements, the engine on the simulator's
virtual clock, and an abort that lands inside a chunk on the production transport."""

from __future__ import annotations

import anyio
import pytest

from actors.engine.chunking import MAX_PASSES, MIN_CHUNK_TOKENS, MIN_PASSES, ChunkSizer
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Cancel, Cancelled, Finished, Started
from runtime.testing.harness import engine_stats, make_sim, sim_spec
from runtime.testing.requests import generate

# ---------------------------------------------------------------------- the sizer


def test_the_cap_until_a_chunk_is_measured_and_always_without_a_budget() -> None:
    sizer = ChunkSizer(cap=256, budget_s=0.05)
    assert sizer.tokens() == 256
    fixed = ChunkSizer(cap=256, budget_s=0.0)
    fixed.observe(100, 10.0)  # however slow
    assert fixed.tokens() == 256


def test_a_chunk_takes_as_many_tokens_as_the_measured_rate_fits_in_the_budget() -> None:
    sizer = ChunkSizer(cap=1024, budget_s=0.05)
    sizer.observe(100, 0.1)  # 1 ms a token
    assert sizer.tokens() == 50
    sizer.observe(100, 0.05)  # faster now: the newer chunk weighs more
    assert 50 < sizer.tokens() <= 100


def test_a_long_chunk_weighs_more_than_a_short_one() -> None:
    sizer = ChunkSizer(cap=1024, budget_s=0.1)
    sizer.observe(256, 0.256)  # 1 ms a token
    sizer.observe(8, 0.024)  # 3 ms a token
    assert 75 <= sizer.tokens() < 100  # not the 33 that the short chunk alone would give


def test_a_pass_s_fixed_cost_is_not_counted_as_the_rate() -> None:
    sizer = ChunkSizer(cap=1024, budget_s=0.5)
    sizer.loaded(pass_s=1 / 16, stop_checks=4)  # the floor: 8 passes, the budget
    sizer.observe(16, 1 / 16 + 16 / 256)  # half of it the pass's fixed cost
    assert sizer.tokens() == 112  # (0.5 - 1/16) * 256, not 0.5 / (0.125 / 16) = 64
    sizer.observe(4, 0.05)  # faster than a pass (noise): no rate to learn from it
    assert sizer.tokens() == 112


def test_a_model_with_few_stop_checks_takes_shorter_chunks() -> None:
    # An abort waits for one stop check (an attention layer): two passes' time per check.
    def floor(stop_checks: int) -> int:
        sizer = ChunkSizer(cap=1024, budget_s=0.001)
        sizer.loaded(pass_s=0.005, stop_checks=stop_checks)
        sizer.observe(100, 0.105)
        return sizer.tokens() // 5 + 1  # in passes

    assert [floor(n) for n in (1, 4, 6, 18, 0)] == [MIN_PASSES, 8, 12, MAX_PASSES, MAX_PASSES]


def test_a_chunk_takes_at_least_a_few_passes_time_and_stays_within_its_bounds() -> None:
    sizer = ChunkSizer(cap=1024, budget_s=0.01)
    sizer.loaded(pass_s=0.005, stop_checks=0)
    sizer.observe(100, 0.105)  # a pass and 1 ms a token
    assert sizer.tokens() == (MAX_PASSES - 1) * 5  # the floor's time, not the budget's
    sizer.observe(10, 100.0)  # absurdly slow
    assert sizer.tokens() == MIN_CHUNK_TOKENS
    small = ChunkSizer(cap=8, budget_s=0.001)
    small.observe(8, 1.0)
    assert small.tokens() == 8  # a cap below the token floor stays the chunk
    quick = ChunkSizer(cap=64, budget_s=1.0)
    quick.observe(64, 0.001)
    assert quick.tokens() == 64


# ---------------------------------------------------------------------- the engine (virtual time)

PER_TOKEN = 0.001


def _cancel_latency(budget_ms: float) -> float:
    """Virtual seconds from a cancel inside a long prefill to its ``Cancelled``."""
    spec = sim_spec(chunk=256, prefill_s_per_token=PER_TOKEN, prefill_chunk_ms=budget_ms)
    sim = make_sim(spec)
    # Its chunks teach the engine the rate (ids wrap into the simulated vocabulary of 257).
    sim.send(generate("warm", tuple(t % 256 for t in range(300)), 1))
    sim.run_until_quiescent()
    sim.send(generate("long", tuple(t % 256 for t in range(1, 1001)), 1, incarnation=2))
    sim.advance(0.3)  # into the prefill, 0.044 s into a 256-token chunk of the fixed plan
    cancelled_at = sim.clock.now
    sim.send(Cancel(request_id="long", incarnation=2))
    sim.run_until(lambda: sim.terminal("long", 2) is not None)
    assert isinstance(sim.terminal("long", 2), Cancelled)
    return sim.clock.now - cancelled_at


def test_an_abort_lands_within_the_budget_once_the_rate_is_measured() -> None:
    assert _cancel_latency(budget_ms=50) <= 0.05 + 0.001
    assert _cancel_latency(budget_ms=0) > 0.2  # fixed 256-token chunks: the rest of one


# ---------------------------------------------------------------------- an abort inside a chunk


@pytest.mark.anyio
async def test_an_abort_stops_the_chunk_it_lands_in() -> None:
    # One chunk would take 10 s; the backend gives up between tokens once the abort flag is set
    # (as MLX's gives up between layers), so the request behind it runs at once.
    spec = sim_spec(chunk=1000, prefill_s_per_token=0.01, prefill_chunk_ms=0)
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        loaded = await rt.load_model(spec)
        async with rt.generate("m", "x" * 1000, max_tokens=1) as stream:
            async for event in stream:
                assert isinstance(event, Started)
                break
        with anyio.fail_after(5):
            short = await rt.complete("m", "hi", max_tokens=1)
        assert isinstance(short.terminal, Finished)
        counters = engine_stats(rt, loaded).counters
        assert counters["cancelled"] == 1
        assert counters["prefilled_tokens"] == 2  # the interrupted chunk left nothing behind
