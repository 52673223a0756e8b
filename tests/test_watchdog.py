"""The engine watchdog and engine restarts on the simulator (virtual time only).

A compute step that overruns ``step_timeout_s`` means a stuck engine: each of its sequences ends
``Failed(step_timeout, retryable)``, its memory and prefix entries are given back, and the router
reloads the model at a new epoch, as often as ``engine_restart`` allows; beyond that the model is
failed (requests get ``model_failed``) until it is loaded again, and the rest keeps serving.
"""

from __future__ import annotations

from actors.engine.watchdog import Watchdog
from runtime.backends.simulated import greedy_continuation
from runtime.errors import error_for_code
from runtime.kernel.supervision import RestartPolicy
from runtime.messages import (
    Cancelled,
    ComputeWatch,
    Failed,
    Finished,
    ModelLoaded,
    ModelSpec,
    ModelUnloaded,
    Rejected,
    UnloadModel,
)
from runtime.testing.faults import Fault, FaultKind, FaultPlan, FaultPoint
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
from runtime.testing.recording import RecordingContext
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001
LIMIT_S = 2.0
PROMPT = tuple(range(1, 41))


def spec(name: str = "m", **options: ModelOption) -> ModelSpec:
    timing = {"prefill_s_per_token": PER_TOKEN, "decode_s_per_token": PER_TOKEN}
    return sim_spec(name, chunk=16, **{**timing, **options})


def ended(sim: Simulator, *request_ids: str) -> bool:
    return all(sim.terminal(r, 1) is not None for r in request_ids)


def assert_step_timeout(sim: Simulator, request_id: str) -> None:
    terminal = sim.terminal(request_id, 1)
    assert isinstance(terminal, Failed), terminal
    assert terminal.code == "step_timeout" and terminal.retryable
    assert "step_timeout_s" in terminal.message


def assert_served(sim: Simulator, request_id: str, model: str = "m") -> None:
    sim.send(generate(request_id, PROMPT, model=model))
    sim.run_until(lambda: ended(sim, request_id))
    assert isinstance(sim.terminal(request_id, 1), Finished), sim.terminal(request_id, 1)
    assert sim.emitted_tokens(request_id, 1) == greedy_continuation(PROMPT, 4)


def assert_all_given_back(sim: Simulator) -> None:
    sim.run_until_quiescent()
    assert router(sim).live_sequences() == {}
    assert all(core.statistics().gauges["sequences"] == 0 for core in engines(sim))
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_a_hung_step_fails_every_sequence_of_the_engine_and_the_model_reloads() -> None:
    plan = FaultPlan()
    sim = make_sim(spec(), faults=plan, step_timeout_s=LIMIT_S)
    sim.send(generate("cached", tuple(range(100, 120))))  # leaves a prefix entry
    sim.run_until(lambda: ended(sim, "cached"))
    plan.arm(Fault(FaultPoint.DECODE, FaultKind.HANG))
    started = sim.clock.now
    sim.send(generate("stuck", PROMPT, max_tokens=8))
    sim.send(generate("waiting", tuple(range(50, 90)), max_tokens=8))
    sim.run_until(lambda: ended(sim, "stuck", "waiting"))
    assert_step_timeout(sim, "stuck")
    assert_step_timeout(sim, "waiting")
    assert LIMIT_S <= sim.clock.now - started < LIMIT_S + 0.1
    sim.run_until_quiescent()
    assert engine(sim).epoch == 2  # reloaded at a new epoch
    assert prefix_cache(sim).total_bytes == 0  # the old epoch's entries are gone with it
    failures = router(sim).counters.snapshot()
    assert failures["engines_failed"] == failures["engines_failed:m"] == 1  # total, and by model
    assert_served(sim, "after")
    assert_all_given_back(sim)


def test_a_step_that_overruns_the_limit_is_stuck_and_its_late_result_is_dropped() -> None:
    plan = FaultPlan(Fault(FaultPoint.PREFILL, FaultKind.SLOW, seconds=10.0))
    sim = make_sim(spec(), faults=plan, step_timeout_s=LIMIT_S)
    sim.send(generate("slow", PROMPT))
    sim.run_until(lambda: ended(sim, "slow"))
    assert_step_timeout(sim, "slow")
    sim.run_until_quiescent()  # the slow step ends at 10 s, long after the engine gave up
    assert sim.dead_letters["abandoned_compute:ComputeDone"] == 1
    assert_served(sim, "after")
    assert_all_given_back(sim)


def test_the_limit_is_per_step_not_per_request() -> None:
    sim = make_sim(spec(decode_s_per_token=1.5), step_timeout_s=LIMIT_S)
    sim.send(generate("long", PROMPT, max_tokens=6))  # 9 s of decoding, every step within the limit
    sim.run_until_quiescent()
    assert isinstance(sim.terminal("long", 1), Finished)
    assert router(sim).counters.snapshot().get("engines_failed", 0) == 0


def test_requests_while_the_model_reloads_are_rejected_retryably() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG))
    sim = make_sim(spec(load_s=5.0), faults=plan, step_timeout_s=LIMIT_S)
    sim.send(generate("stuck", PROMPT))
    sim.run_until(lambda: router(sim).statistics().gauges["models_restarting"] == 1)
    sim.send(generate("meanwhile", PROMPT))
    sim.run_until_idle()
    rejected = sim.terminal("meanwhile", 1)
    assert isinstance(rejected, Rejected) and rejected.code == "model_restarting"
    assert error_for_code(rejected.code, rejected.message).retryable
    sim.run_until_quiescent()
    assert_served(sim, "after")


def test_beyond_the_restart_intensity_the_model_fails_and_the_rest_keeps_serving() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG, model="m", times=0))
    sim = make_sim(
        spec(),
        spec("other"),
        faults=plan,
        step_timeout_s=LIMIT_S,
        engine_restart=RestartPolicy(max_restarts=1, within_s=60.0),
    )
    for request_id in ("first", "second"):
        sim.send(generate(request_id, PROMPT))
        sim.run_until_quiescent()
        assert_step_timeout(sim, request_id)
    sim.send(generate("refused", PROMPT))
    sim.run_until_idle()
    refused = sim.terminal("refused", 1)
    assert isinstance(refused, Rejected) and refused.code == "model_failed"
    assert "load_model" in refused.message and "failed 2 times within 60 s" in refused.message
    assert not error_for_code(refused.code, refused.message).retryable
    assert router(sim).statistics().gauges["models_failed"] == 1
    assert_served(sim, "elsewhere", model="other")
    assert_all_given_back(sim)
    plan.disable()
    reloaded = sim.load(spec())
    assert isinstance(reloaded, ModelLoaded) and reloaded.epoch == 4
    assert_served(sim, "back")
    assert_all_given_back(sim)


def test_crashes_spread_out_beyond_the_window_keep_restarting() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG, times=0))
    sim = make_sim(
        spec(),
        faults=plan,
        step_timeout_s=LIMIT_S,
        engine_restart=RestartPolicy(max_restarts=1, within_s=10.0),
    )
    for i in range(3):
        sim.send(generate(f"r{i}", PROMPT))
        sim.run_until_quiescent()
        assert_step_timeout(sim, f"r{i}")
        sim.advance(20.0)  # the last crash leaves the window
    assert router(sim).statistics().gauges["models_failed"] == 0
    assert engine(sim).epoch == 4


def test_a_model_whose_reload_fails_is_failed_with_the_load_error() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG))
    sim = make_sim(spec(), faults=plan, step_timeout_s=LIMIT_S)
    plan.arm(Fault(FaultPoint.LOAD))  # the reload
    sim.send(generate("stuck", PROMPT))
    sim.run_until_quiescent()
    assert_step_timeout(sim, "stuck")
    sim.send(generate("refused", PROMPT))
    sim.run_until_idle()
    refused = sim.terminal("refused", 1)
    assert isinstance(refused, Rejected) and refused.code == "model_failed"
    assert "could not be reloaded" in refused.message and "injected" in refused.message
    assert_all_given_back(sim)


def test_a_model_unloaded_while_it_reloads_is_unloaded() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG))
    sim = make_sim(spec(load_s=5.0), faults=plan, step_timeout_s=LIMIT_S)
    sim.send(generate("stuck", PROMPT))
    sim.run_until(lambda: router(sim).statistics().gauges["models_restarting"] == 1)
    assert isinstance(sim.ask(UnloadModel(model="m")), ModelUnloaded)
    assert engines(sim) == []
    assert_step_timeout(sim, "stuck")
    assert_all_given_back(sim)


def test_an_unload_waiting_on_a_stuck_step_ends_once_the_limit_passes() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG))
    sim = make_sim(spec(), faults=plan, step_timeout_s=LIMIT_S)
    sim.send(generate("stuck", PROMPT))
    sim.advance(0.5)  # the step hangs; the drain waits for it
    unloaded = sim.ask(UnloadModel(model="m"))
    assert isinstance(unloaded, ModelUnloaded) and sim.clock.now >= LIMIT_S
    cancelled = sim.terminal("stuck", 1)  # drained: the unload's ending, not a failure
    assert isinstance(cancelled, Cancelled) and cancelled.reason == "model_unloaded"
    assert engines(sim) == []
    assert router(sim).counters.snapshot().get("engines_failed", 0) == 0
    assert_all_given_back(sim)


def test_the_watchdog_sets_its_timer_again_for_the_time_left_and_fires_after_the_limit() -> None:
    ctx = RecordingContext("engine:m#1")
    dog = Watchdog(10.0)
    dog.job_submitted(executor_was_idle=True, ctx=ctx)
    assert ctx.timers == [(10.0, ComputeWatch())]
    dog.job_submitted(executor_was_idle=False, ctx=ctx)  # queued behind: no second timer
    ctx.clock = 4.0
    dog.job_ended(ctx)  # progress at 4 s: the queued job started
    ctx.clock = 10.0
    assert not dog.overdue(busy=True, ctx=ctx)
    assert ctx.timers[1:] == [(14.0, ComputeWatch())]  # 4 s of the limit were left
    ctx.clock = 14.0
    assert dog.overdue(busy=True, ctx=ctx)
    assert not Watchdog(None).overdue(busy=True, ctx=ctx)
    idle = Watchdog(10.0)
    idle.job_submitted(executor_was_idle=True, ctx=ctx)
    assert not idle.overdue(busy=False, ctx=ctx)  # nothing in flight: no timer set again
