"""The shared test harness: the simulator's accessors follow reloads, ``wait_until`` wakes on
actor progress and says what it waited for."""

from __future__ import annotations

import anyio
import pytest

from runtime.errors import RuntimeClosed
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import engine_address
from runtime.messages import LoadModel, ModelLoaded, UnloadModel
from runtime.testing.harness import (
    engine,
    engine_address_of,
    engine_stats,
    engines,
    make_sim,
    sim_spec,
    wait_until,
)

pytestmark = pytest.mark.anyio


def test_the_engine_accessor_follows_the_models_newest_epoch() -> None:
    sim = make_sim(sim_spec(), sim_spec("other"))
    assert engine_address_of(sim) == engine_address("m", 1)
    assert engine_address_of(sim, "other") == engine_address("other", 2)
    sim.ask(UnloadModel(model="m"))
    with pytest.raises(LookupError, match="'m'"):
        engine(sim)
    assert isinstance(sim.ask(LoadModel(spec=sim_spec())), ModelLoaded)
    assert engine_address_of(sim) == engine_address("m", 3)
    assert engine(sim).epoch == 3
    assert sorted(e.epoch for e in engines(sim)) == [2, 3]


def test_make_sim_says_which_model_did_not_load() -> None:
    with pytest.raises(RuntimeError, match="'broken' did not load"):
        make_sim(sim_spec("broken", fail_load=True))


async def test_wait_until_returns_once_the_actors_made_the_condition_hold() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        loaded = await rt.load_model(sim_spec(chunk=8, prefill_s_per_token=0.002))

        def prefilled() -> int:
            return engine_stats(rt, loaded).counters.get("prefilled_tokens", 0)

        async with rt.generate("m", "x" * 400, max_tokens=1):
            await wait_until(rt, lambda: prefilled() >= 16)
            assert 16 <= prefilled() < 400  # woke while the prefill still ran


async def test_wait_until_names_what_it_waited_for_when_it_times_out() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        with pytest.raises(TimeoutError, match="the model is loaded"):
            await wait_until(rt, lambda: False, timeout=0.01, what="the model is loaded")

        def model_loaded() -> bool:
            return engine_address("never", 1) in rt.stats().actors

        with pytest.raises(TimeoutError, match="model_loaded"):
            await wait_until(rt, model_loaded, timeout=0.01)
        with pytest.raises(TimeoutError, match=r"lambda: rt\.stats\(\)\.dead_letters"):
            await wait_until(rt, lambda: rt.stats().dead_letters != {}, timeout=0.01)


async def test_wait_progress_and_engine_stats_outside_the_runtime_raise() -> None:
    rt = Runtime(RuntimeConfig(kv_budget_bytes=64 << 20))
    with pytest.raises(RuntimeClosed):
        await rt.wait_progress()
    async with rt:
        loaded = await rt.load_model(sim_spec())
        assert engine_stats(rt, loaded).actor == engine_address("m", loaded.epoch)
        await rt.unload_model("m")
        with pytest.raises(LookupError, match="no engine runs"):
            engine_stats(rt, loaded)
    with anyio.fail_after(1), pytest.raises(RuntimeClosed):
        await wait_until(rt, lambda: False)
