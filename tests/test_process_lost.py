"""The "engine process lost" fault on the simulator: the engine core is replaced by the stand-in a
lost Ray process leaves (actors/engine/lost.py), mid-decode. Its streams end with a retryable
``engine_process_lost``, the epoch's reservations and entries are released, the model comes back
at a new epoch and serves again; a drain the lost engine had been asked for still completes."""

from __future__ import annotations

from actors.engine.lost import LostEngine
from runtime.host.config import RuntimeConfig
from runtime.messages import Failed, Finished, ModelSpec, ModelUnloaded, UnloadModel
from runtime.testing.faults import Fault, FaultKind, FaultPlan, FaultPoint
from runtime.testing.harness import engine_address_of, engines, kv_keeper, prefix_cache, router
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

SPEC = ModelSpec(name="m", backend="simulated", options={"decode_s_per_token": 0.001})


def make(plan: FaultPlan) -> Simulator:
    sim = Simulator(seed=3, config=RuntimeConfig(kv_budget_bytes=64 << 20), faults=plan)
    sim.load(SPEC)
    return sim


def test_a_lost_engine_process_fails_its_streams_releases_its_epoch_and_comes_back() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.LOSE, after=3, times=1))
    sim = make(plan)
    sim.send(generate("a", (1, 2, 3, 4), 20))
    sim.run_until_quiescent()
    failed = sim.terminal("a", 1)
    assert isinstance(failed, Failed), failed
    assert failed.code == "engine_process_lost" and failed.retryable
    assert sim.lost_engines == 1
    assert router(sim).statistics().counters["engines_failed"] == 1
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes
    assert {h.epoch for h in kv_keeper(sim).holdings()} <= {e.epoch for e in engines(sim)}
    assert not any(isinstance(sim.core(a), LostEngine) for a in sim.addresses())  # stopped
    sim.send(generate("b", (1, 2, 3, 4), 4))
    sim.run_until_quiescent()
    done = sim.terminal("b", 1)
    assert isinstance(done, Finished), done
    assert done.usage.completion_tokens == 4


def test_a_drain_sent_to_an_engine_whose_process_is_then_lost_still_completes() -> None:
    sim = make(FaultPlan())
    sim.send(generate("a", (1, 2, 3, 4), 50))
    sim.advance(0.01)
    (engine,) = engines(sim)
    address = engine_address_of(sim)
    sim.send(UnloadModel(model="m"), sender="host:unload")
    sim.run_until(lambda: engine.drain_requester is not None)
    sim.lose_engine(address)
    sim.run_until_quiescent()
    assert sim.lost_engines == 1
    assert sim.terminal("a", 1) is not None  # ended by the unload or the loss, once
    assert not engines(sim)
    assert kv_keeper(sim).reserved_bytes == 0
    assert any(isinstance(m, ModelUnloaded) for m in sim.host_messages)
