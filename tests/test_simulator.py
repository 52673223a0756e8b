"""Protocol examples on the deterministic simulator (virtual time, seeded interleavings)."""

from __future__ import annotations

from runtime.backends.simulated import greedy_continuation
from runtime.kernel.core import engine_address
from runtime.messages import (
    Abort,
    Cancel,
    Cancelled,
    Finished,
    ModelSpec,
    SequenceFinished,
    Started,
    UnloadModel,
    Usage,
)
from runtime.testing.harness import (
    ModelOption,
    engine,
    engine_address_of,
    kv_keeper,
    make_sim,
    prefix_cache,
    router,
    sim_spec,
)
from runtime.testing.requests import generate

PER_TOKEN = 0.001
CHUNK = 16


def spec(**options: ModelOption) -> ModelSpec:
    """Model "m": CHUNK-token chunks, every token costs PER_TOKEN of virtual time."""
    return sim_spec(
        chunk=CHUNK, prefill_s_per_token=PER_TOKEN, decode_s_per_token=PER_TOKEN, **options
    )


def run_program(seed: int) -> list[str]:
    sim = make_sim(spec(), seed=seed)
    for i in range(4):
        sim.send(generate(f"r{i}", tuple(range(10 + i)), incarnation=i + 1, max_tokens=3))
    sim.advance(0.004)
    sim.send(Cancel(request_id="r2", incarnation=3))
    sim.run_until_quiescent()
    return sim.trace


def test_same_seed_same_trace() -> None:
    assert run_program(3) == run_program(3)
    assert any(run_program(3) != run_program(seed) for seed in range(4, 10))


def test_cancel_mid_prefill_stops_at_the_next_chunk_boundary() -> None:
    sim = make_sim(spec())
    prompt = tuple(range(50, 250))  # 200 tokens: 12.5 chunks
    sim.send(generate("a", prompt, 4))
    sim.advance(CHUNK * PER_TOKEN * 3.5)  # inside the fourth chunk
    sim.send(Cancel(request_id="a", incarnation=1))
    sim.run_until_quiescent()
    terminal = sim.terminal("a", 1)
    assert isinstance(terminal, Cancelled) and terminal.reason == "cancelled"
    assert terminal.usage == Usage(prompt_tokens=200, cached_prompt_tokens=0, completion_tokens=0)
    assert engine(sim).counters["prefilled_tokens"] == 4 * CHUNK
    # The aborted prefill is kept: the keystroke that extends the prompt resumes from it.
    sim.send(generate("b", (*prompt, 7, 8), 4, incarnation=2))
    sim.run_until_quiescent()
    started = next(e for e in sim.events("b", 2) if isinstance(e, Started))
    assert started.cached_tokens == 4 * CHUNK
    assert sim.emitted_tokens("b", 2) == greedy_continuation((*prompt, 7, 8), 4)


def test_a_cancel_for_an_earlier_incarnation_never_hits_a_reused_id() -> None:
    sim = make_sim(spec())
    sim.send(generate("same", (1, 2, 3), max_tokens=2))
    sim.run_until_quiescent()
    assert isinstance(sim.terminal("same", 1), Finished)
    # The host reuses the id; a cancel it sent for the first incarnation arrives late.
    sim.send(generate("same", (4, 5, 6), incarnation=2, max_tokens=6))
    sim.send(Cancel(request_id="same", incarnation=1))
    sim.run_until_quiescent()
    terminal = sim.terminal("same", 2)
    assert isinstance(terminal, Finished) and terminal.usage.completion_tokens == 6
    assert router(sim).counters["cancels_noop"] == 1


def test_an_abort_after_the_last_step_is_a_counted_noop() -> None:
    sim = make_sim(spec())
    sim.send(generate("a", (1, 2, 3), max_tokens=2))
    sim.run_until_quiescent()
    sim.deliver(engine_address_of(sim), Abort(sequence_id=1, epoch=1), "router")
    sim.run_until_quiescent()
    assert [type(e) for e in sim.events("a", 1)].count(Finished) == 1
    assert engine(sim).counters["aborts_noop"] == 1


def test_stale_epoch_messages_are_dropped_and_counted() -> None:
    sim = make_sim(spec())
    sim.send(generate("a", (1, 2, 3), max_tokens=30))
    sim.advance(0.01)
    stale = SequenceFinished(sequence_id=1, epoch=0, reason="stop", usage=Usage())  # type: ignore[arg-type]
    sim.deliver("router", stale, engine_address("m", 0))
    sim.run_until_quiescent()
    terminal = sim.terminal("a", 1)
    assert isinstance(terminal, Finished) and terminal.usage.completion_tokens == 30
    assert router(sim).counters["stale_engine_events"] == 1


def test_unload_waits_for_the_step_in_flight_and_releases_everything() -> None:
    sim = make_sim(spec())
    address = engine_address_of(sim)
    sim.send(generate("a", tuple(range(100)), max_tokens=5))
    sim.advance(0.005)
    reply = sim.ask(UnloadModel(model="m"))
    assert reply == type(reply)(model="m", epoch=1)
    terminal = sim.terminal("a", 1)
    assert isinstance(terminal, Cancelled) and terminal.reason == "model_unloaded"
    assert sim.host_messages.index(terminal) >= 0
    assert kv_keeper(sim).reserved_bytes == 0
    assert prefix_cache(sim).total_bytes == 0
    assert address not in sim.addresses()


def test_a_waiting_reservation_is_served_once_a_finished_request_leaves_an_evictable_entry() -> (
    None
):
    model = sim_spec(bytes_per_token=100, decode_s_per_token=PER_TOKEN)
    sim = make_sim(model, budget=10_000, reservation_timeout_s=30.0)
    sim.send(generate("hog", tuple(range(10)), max_tokens=60))  # 7,000 of 10,000 bytes
    sim.advance(0.005)
    sim.send(generate("next", tuple(range(20, 30)), incarnation=2, max_tokens=30))  # 4,000: waits
    sim.run_until(lambda: sim.terminal("next", 2) is not None)
    # The hog's cached state (7,000 bytes) was evicted for it at once, not at the 15 s pressure
    # point or the 30 s deadline.
    assert isinstance(sim.terminal("next", 2), Finished)
    assert sim.clock.now < 1.0
