"""Replicas on the simulator (actors/replicas.py): one name, several engines, each request routed
to one. Loading and unloading answer once for all; a session stays on its replica (its prewarm
lands where its requests do); a request routed away from the replica holding its prompt's prefix
moves there (exact, by token prefix), unless that replica is overloaded; a lost replica's
unstarted requests go to another, its streams fail retryably, and it comes back."""

from __future__ import annotations

import msgspec
import pytest

from actors.deadlines import RequestGuards
from runtime.errors import InvalidModelSpec, RequestTimedOut
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import ROUTER, engine_model
from runtime.kernel.stats import Counters
from runtime.messages import (
    EndSession,
    Failed,
    Finished,
    ListModels,
    ModelLoaded,
    ModelsListed,
    ModelSpec,
    ModelUnloaded,
    PrefixesReset,
    ResetPrefixes,
    SessionEnded,
    Started,
    UnloadModel,
)
from runtime.testing.harness import engine_address_of, engines, kv_keeper, prefix_cache, router
from runtime.testing.recording import RecordingContext
from runtime.testing.requests import generate, prewarm
from runtime.testing.simulator import Simulator

OPTIONS = {"prefill_s_per_token": 0.0001, "decode_s_per_token": 0.001}
SPEC = ModelSpec(name="m", backend="simulated", options=OPTIONS, replicas=2)
LONG = tuple(range(10, 90))  # 80 tokens


def make(seed: int = 1) -> Simulator:
    sim = Simulator(seed=seed, config=RuntimeConfig(kv_budget_bytes=256 << 20))
    loaded = sim.load(SPEC)
    assert isinstance(loaded, ModelLoaded) and loaded.model == "m", loaded
    return sim


def replica_of(sim: Simulator, rid: str) -> str:
    """The replica whose engine started ``rid`` (by the epoch its Started names)."""
    started = [e for e in sim.events(rid, 1) if isinstance(e, Started)][-1]
    (engine,) = [e for e in engines(sim) if e.epoch == started.epoch]
    return engine.model


def test_a_model_with_replicas_loads_and_unloads_as_one_name() -> None:
    sim = make()
    listed = sim.ask(ListModels())
    assert isinstance(listed, ModelsListed)
    assert [(s.name, s.state) for s in listed.models] == [("m@0", "loaded"), ("m@1", "loaded")]
    assert isinstance(sim.ask(UnloadModel(model="m")), ModelUnloaded)
    assert not engines(sim)
    assert kv_keeper(sim).reserved_bytes == 0


def test_concurrent_requests_spread_and_a_session_stays_on_its_replica() -> None:
    sim = make()
    sim.send(generate("a", (1, 2, 3), max_tokens=20))
    sim.send(generate("b", (1, 2, 3), max_tokens=20))
    sim.run_until_quiescent()
    assert {replica_of(sim, "a"), replica_of(sim, "b")} == {"m@0", "m@1"}
    sim.send(prewarm("w", LONG, session="s"))
    sim.run_until_quiescent()
    for turn in range(3):
        sim.send(generate(f"s{turn}", LONG + (5,) * turn, 4, session="s"))
        sim.send(generate(f"x{turn}", (7, 7, 7), max_tokens=30))  # other load, meanwhile
        sim.run_until_quiescent()
        assert replica_of(sim, f"s{turn}") == replica_of(sim, "w")
    assert all(isinstance(sim.terminal(f"s{t}", 1), Finished) for t in range(3))


def test_a_request_moves_to_the_replica_holding_its_prefix_unless_it_is_overloaded() -> None:
    sim = make()
    sim.send(generate("first", LONG, 4))
    sim.run_until_quiescent()
    holder = replica_of(sim, "first")
    sim.send(generate("busy", (9, 9, 9), max_tokens=400))  # the least busy is now the other replica
    sim.advance(0.01)
    sim.send(generate("again", (*LONG, 1, 2), 4))
    sim.run_until_quiescent()
    assert replica_of(sim, "again") == holder
    assert router(sim).statistics().counters["requests_moved"] == 1
    done = sim.terminal("again", 1)
    assert isinstance(done, Finished) and done.usage.cached_prompt_tokens >= len(LONG) - 1
    # With the holder's queue costing more than the 80 tokens its cache saves (three 2000-token
    # prompts still to prefill: actors/replica_costs.py), the request stays where it was routed.
    # The session "pin" sticks to the holder: its first request moved there.
    sim.send(generate("load0", (*LONG, 99), max_tokens=400, session="pin"))
    sim.advance(0.01)
    for i in range(1, 4):
        prompt = (200 + i, *((k * 7) % 256 for k in range(2000)))
        sim.send(generate(f"load{i}", prompt, max_tokens=400, session="pin"))  # on the holder
    sim.advance(0.001)  # their lookups answered, their prefills (0.2 s each) not finished
    sim.send(generate("second", (*LONG, 3, 4), 4, session="pin-elsewhere"))
    sim.run_until_quiescent()
    assert router(sim).statistics().counters["moves_declined"] >= 1
    assert replica_of(sim, "second") != holder
    assert router(sim).statistics().counters["requests_moved"] == 2
    assert {replica_of(sim, f"load{i}") for i in range(4)} == {holder}
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_a_moved_request_is_not_tokenized_again() -> None:
    sim = make()
    text = "the quick brown fox jumps over the lazy dog " * 3  # the simulated tokenizer: bytes
    first = generate("first", max_tokens=4, prompt=text)
    sim.send(first)
    sim.run_until_quiescent()
    holder = replica_of(sim, "first")
    sim.send(generate("busy", (9, 9, 9), max_tokens=400))  # the least busy is now the other replica
    sim.advance(0.01)
    sim.send(generate("again", max_tokens=4, prompt=text + "again"))
    sim.run_until_quiescent()
    assert replica_of(sim, "again") == holder
    done = sim.terminal("again", 1)
    assert isinstance(done, Finished) and done.usage.cached_prompt_tokens >= len(text) - 1
    # Two text prompts, one tokenization each: the replica it moved to took its first tokens.
    counters = [engine.counters.snapshot() for engine in engines(sim)]
    assert sum(c.get("prompts_tokenized", 0) for c in counters) == 2  # "busy" came as tokens
    assert sum(c.get("admitted_tokenized", 0) for c in counters) == 1


def test_a_moved_request_keeps_the_deadline_it_was_first_accepted_with() -> None:
    guards = RequestGuards(None, Counters())
    ctx = RecordingContext(ROUTER, clock=100.0)
    request = generate("r", (1, 2, 3), 4, timeout_s=60.0)
    guards.accepted(request, 1, 1, ctx)
    guards.ended(1)  # moved: its first sequence is let go ...
    ctx.clock = 103.0
    guards.accepted(request, 2, 2, ctx, since=100.0)  # ... and it is accepted again elsewhere
    ctx.clock = 160.0
    expiries = guards.fired(ctx)
    assert [sequence_id for sequence_id, _ in expiries] == [2]  # at 160 s, not 163 s
    assert isinstance(expiries[0][1].error, RequestTimedOut)


def test_a_lost_replica_fails_its_streams_and_its_unstarted_requests_go_to_another() -> None:
    sim = make()
    sim.send(generate("stream", (4, 4, 4), max_tokens=200, session="one"))
    sim.advance(0.02)
    lost = engine_address_of(sim, replica_of(sim, "stream"))
    sim.send(generate("queued", LONG, 4, session="one"))  # same replica, not started yet
    sim.lose_engine(lost)
    sim.run_until_quiescent()
    failed = sim.terminal("stream", 1)
    assert isinstance(failed, Failed) and failed.code == "engine_process_lost" and failed.retryable
    assert isinstance(sim.terminal("queued", 1), Finished)
    assert replica_of(sim, "queued") != engine_model(lost)
    assert router(sim).statistics().counters["requests_moved"] >= 1
    listed = sim.ask(ListModels())
    assert isinstance(listed, ModelsListed)
    assert {s.state for s in listed.models} == {"loaded"}  # the lost one came back
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_round_robin_takes_turns_and_never_moves_a_request() -> None:
    sim = Simulator(seed=1, config=RuntimeConfig(kv_budget_bytes=256 << 20))
    sim.load(msgspec.structs.replace(SPEC, routing="round_robin"))
    for i in range(4):
        sim.send(generate(f"r{i}", (*LONG, i), 4))
        sim.run_until_quiescent()
    assert [replica_of(sim, f"r{i}") for i in range(4)] == ["m@1", "m@0", "m@1", "m@0"]
    assert router(sim).statistics().counters.get("requests_moved", 0) == 0


@pytest.mark.anyio
async def test_replicas_and_routing_are_checked_before_anything_loads() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        with pytest.raises(InvalidModelSpec, match="routing"):
            await rt.load_model(msgspec.structs.replace(SPEC, routing="nearest"))
        with pytest.raises(InvalidModelSpec, match="replicas"):
            await rt.load_model(msgspec.structs.replace(SPEC, replicas=0))
        assert await rt.list_models() == ()


def test_ending_a_session_reaches_the_replica_that_holds_it() -> None:
    sim = make()
    sim.send(
        generate("busy", (9, 9), max_tokens=300)
    )  # the session's first request goes to the other
    sim.send(generate("s", LONG, 4, session="editor"))
    sim.run_until_quiescent()
    ended = sim.ask(EndSession(model="m", session="editor"))
    assert isinstance(ended, SessionEnded) and ended.model == replica_of(sim, "s"), ended


def test_resetting_a_model_with_replicas_resets_every_replica_once() -> None:
    sim = make()
    sim.send(generate("a", (1, 2, 3, 4), 4))
    sim.send(generate("b", (5, 6, 7, 8), 4))  # one on each replica, each leaves an entry
    sim.run_until_quiescent()
    assert {replica_of(sim, "a"), replica_of(sim, "b")} == {"m@0", "m@1"}
    held = len(prefix_cache(sim).entries())
    assert held >= 2
    reset = sim.ask(ResetPrefixes(model="m"))
    assert reset == PrefixesReset(model="m", dropped=held)
    assert not prefix_cache(sim).entries()
