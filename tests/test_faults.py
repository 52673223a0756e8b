"""Faults injected at each point (runtime/testing/faults.py) on the simulator: what the affected
requests get, and that everything they held is given back (virtual time only)."""

from __future__ import annotations

import pytest

from runtime.backends.simulated import SimulatedBatch, greedy_continuation
from runtime.errors import error_for_code
from runtime.kernel.core import KV_KEEPER
from runtime.messages import (
    Cancel,
    Cancelled,
    CommandFailed,
    Failed,
    Finished,
    ModelLoaded,
    ModelSpec,
)
from runtime.testing.faults import (
    Fault,
    FaultKind,
    FaultPlan,
    FaultPoint,
    FaultyKeeper,
    Injection,
    without_faults,
)
from runtime.testing.harness import (
    ModelOption,
    engine,
    engines,
    kv_keeper,
    make_sim,
    prefix_cache,
    router,
    sim_spec,
)
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001
CHUNK = 16
PROMPT = tuple(range(1, 41))  # 40 tokens: three prefill chunks


def spec(name: str = "m", **options: ModelOption) -> ModelSpec:
    timing = {"prefill_s_per_token": PER_TOKEN, "decode_s_per_token": PER_TOKEN}
    return sim_spec(name, chunk=CHUNK, **timing, **options)


def failed(sim: Simulator, request_id: str) -> Failed:
    terminal = sim.terminal(request_id, 1)
    assert isinstance(terminal, Failed), terminal
    return terminal


def assert_served(sim: Simulator, request_id: str, tokens: tuple[int, ...] = PROMPT) -> None:
    """A request sent now finishes with the cold greedy tokens."""
    sim.send(generate(request_id, tokens))
    sim.run_until_quiescent()
    assert isinstance(sim.terminal(request_id, 1), Finished)
    assert sim.emitted_tokens(request_id, 1) == greedy_continuation(tokens, 4)


def assert_all_given_back(sim: Simulator) -> None:
    """At quiescence no request is live anywhere and the keeper holds exactly the prefix
    entries' bytes: every reservation, lease and padding of the failed requests came back."""
    sim.run_until_quiescent()
    assert router(sim).live_sequences() == {}
    assert all(core.statistics().gauges["sequences"] == 0 for core in engines(sim))
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_a_raise_in_a_prefill_chunk_fails_only_that_request_retryably() -> None:
    plan = FaultPlan(Fault(FaultPoint.PREFILL, after=1))  # the second chunk
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", PROMPT))
    sim.run_until_quiescent()
    assert failed(sim, "a").code == "backend_error" and failed(sim, "a").retryable
    assert plan.injected == [Injection(FaultPoint.PREFILL, "m", FaultKind.RAISE)]
    assert engine(sim).epoch == 1  # a step's fault is the request's, not the engine's
    assert_served(sim, "b")
    assert_all_given_back(sim)


def test_a_chunk_that_fails_after_its_cancel_arrived_ends_cancelled_and_is_not_kept() -> None:
    # The cancel reaches the engine while the chunk runs; then the chunk raises. The client asked
    # to stop, so it hears Cancelled (no error tells it of a step it gave up on); the state that
    # saw the error is dropped, not kept for reuse as an aborted prefill's is.
    chunk_s = CHUNK * PER_TOKEN
    plan = FaultPlan(Fault(FaultPoint.PREFILL, after=1, seconds=chunk_s))  # the second chunk
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", PROMPT))
    sim.advance(1.5 * chunk_s)  # inside the second chunk
    sim.send(Cancel(request_id="a", incarnation=1))
    sim.run_until_quiescent()
    assert isinstance(sim.terminal("a", 1), Cancelled)
    assert plan.injected == [Injection(FaultPoint.PREFILL, "m", FaultKind.RAISE)]
    assert engine(sim).statistics().counters["cancelled_after_failed_step"] == 1
    assert prefix_cache(sim).total_bytes == 0  # the first chunk's prefix is not offered again
    assert_all_given_back(sim)
    assert_served(sim, "b")


def test_a_raise_in_a_decode_step_fails_the_request_after_the_tokens_it_had() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, after=2))
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", PROMPT, max_tokens=6))
    sim.run_until_quiescent()
    assert failed(sim, "a").code == "backend_error" and failed(sim, "a").retryable
    assert sim.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 2)
    assert_served(sim, "b", tuple(range(50, 70)))
    assert_all_given_back(sim)


def test_a_raise_in_a_batch_step_fails_its_members_and_frees_the_padding() -> None:
    plan = FaultPlan(Fault(FaultPoint.BATCH_STEP))
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", tuple(range(1, 11)), max_tokens=8))
    sim.send(generate("b", tuple(range(20, 40)), max_tokens=8))
    sim.run_until_quiescent()
    for request_id in ("a", "b"):
        assert failed(sim, request_id).code == "backend_error"
        assert failed(sim, request_id).retryable
    assert [i.point for i in plan.injected] == [FaultPoint.BATCH_STEP]
    assert engine(sim).decode_batch is None  # the failed batch was dropped
    assert_served(sim, "c")
    assert_all_given_back(sim)


def test_a_raise_in_prompts_prefilled_together_fails_each_newcomer_of_that_pass() -> None:
    # Found by the fuzzer: prefill_together was not a fault point, so no prefill fault reached
    # generates that arrive together.
    plan = FaultPlan(Fault(FaultPoint.PREFILL))
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", tuple(range(1, 11)), max_tokens=4))
    sim.send(generate("b", tuple(range(20, 30)), max_tokens=4))
    sim.run_until_quiescent()
    for request_id in ("a", "b"):
        assert failed(sim, request_id).code == "backend_error"
        assert failed(sim, request_id).retryable
    assert [i.point for i in plan.injected] == [FaultPoint.PREFILL]
    assert_served(sim, "c")
    assert_all_given_back(sim)


def test_a_raise_while_taking_a_snapshot_fails_the_request_and_frees_its_snapshot_room() -> None:
    plan = FaultPlan(Fault(FaultPoint.SNAPSHOT))
    # Non-trimmable: its prefill snapshots (at least the end of the prompt less one token).
    sim = make_sim(spec(trimmable=False, fixed_state_bytes=4096), faults=plan)
    sim.send(generate("a", tuple(range(1, 201))))
    sim.run_until_quiescent()
    assert failed(sim, "a").code == "backend_error" and failed(sim, "a").retryable
    assert [i.point for i in plan.injected] == [FaultPoint.SNAPSHOT]
    assert_all_given_back(sim)


def test_a_slow_step_within_the_limit_only_takes_longer() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.SLOW, seconds=5.0))
    sim = make_sim(spec(), faults=plan, step_timeout_s=60.0)
    sim.send(generate("a", PROMPT))
    sim.run_until(lambda: sim.terminal("a", 1) is not None)
    assert isinstance(sim.terminal("a", 1), Finished)
    assert sim.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 4)
    assert sim.clock.now >= 5.0
    assert_all_given_back(sim)


def test_a_refused_reservation_fails_the_request_retryably_and_the_next_one_is_served() -> None:
    plan = FaultPlan(Fault(FaultPoint.RESERVE))
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", PROMPT))
    sim.run_until_quiescent()
    refused = failed(sim, "a")
    assert refused.code == "kv_budget_exhausted" and refused.retryable
    assert error_for_code(refused.code, refused.message).retryable
    assert_served(sim, "b")
    assert_all_given_back(sim)


def test_a_failed_load_is_reported_and_the_model_loads_on_the_next_try() -> None:
    plan = FaultPlan(Fault(FaultPoint.LOAD))
    sim = make_sim(faults=plan)
    reply = sim.load(spec())
    assert isinstance(reply, CommandFailed) and reply.code == "model_load_failed"
    assert "injected" in reply.message
    assert isinstance(sim.load(spec()), ModelLoaded)
    assert_served(sim, "a")
    assert_all_given_back(sim)


def test_a_fault_aimed_at_one_model_leaves_the_others_alone() -> None:
    plan = FaultPlan(Fault(FaultPoint.PREFILL, model="m", times=0))
    sim = make_sim(spec(), spec("other"), faults=plan)
    sim.send(generate("a", PROMPT))
    sim.send(generate("b", PROMPT, model="other"))
    sim.run_until_quiescent()
    assert failed(sim, "a").code == "backend_error"
    assert isinstance(sim.terminal("b", 1), Finished)
    assert_all_given_back(sim)


def test_faults_are_switched_off_and_on_while_the_runtime_runs() -> None:
    plan = FaultPlan(rate=1.0, points=[FaultPoint.PREFILL])
    sim = make_sim(spec(), faults=plan)
    plan.disable()
    assert_served(sim, "a")
    plan.enable()
    sim.send(generate("b", tuple(range(60, 80))))
    sim.run_until_quiescent()
    assert failed(sim, "b").code == "backend_error"
    assert_all_given_back(sim)


def run_with_random_faults(seed: int) -> tuple[list[Injection], list[str]]:
    kinds = (FaultKind.RAISE, FaultKind.SLOW)
    points = [p for p in FaultPoint if p is not FaultPoint.LOAD]  # the model must load
    plan = FaultPlan(seed=seed, rate=0.2, points=points, kinds=kinds, slow_s=0.5)
    sim = make_sim(spec(), seed=seed, faults=plan)
    for i in range(6):
        sim.send(generate(f"r{i}", tuple(range(i, i + 30)), max_tokens=5))
    sim.run_until_quiescent()
    assert_all_given_back(sim)
    ends = [type(sim.terminal(f"r{i}", 1)).__name__ for i in range(6)]
    return plan.injected, ends


def test_random_faults_repeat_from_their_seed() -> None:
    first = run_with_random_faults(3)
    assert first == run_with_random_faults(3)
    assert first[0], "a rate of 0.2 over some 40 calls injects something"


def test_a_fault_a_point_cannot_do_is_refused() -> None:
    with pytest.raises(ValueError, match="load fault can only be"):
        Fault(FaultPoint.LOAD, FaultKind.HANG)
    with pytest.raises(ValueError, match="reserve fault can only be"):
        Fault(FaultPoint.RESERVE, FaultKind.SLOW)


def test_without_faults_reads_through_the_wrappers() -> None:
    plan = FaultPlan()
    sim = make_sim(spec(), faults=plan)
    sim.send(generate("a", tuple(range(1, 11)), max_tokens=8))
    sim.send(generate("b", tuple(range(20, 40)), max_tokens=8))
    sim.run_until(lambda: engine(sim).decode_batch is not None)
    assert isinstance(without_faults(engine(sim).decode_batch), SimulatedBatch)
    keeper = sim.core(KV_KEEPER)
    assert isinstance(keeper, FaultyKeeper) and without_faults(keeper) is kv_keeper(sim)
    assert without_faults(sim) is sim
