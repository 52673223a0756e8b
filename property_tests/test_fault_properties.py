"""Under any seeded mix of injected faults (raises, slow and hung steps, refused reservations),
on the simulator: every request ends exactly once, failures are retryable, nothing is left
holding memory, and with faults switched off the runtime serves again (safety, then liveness).

The whole-runtime state machine (``test_runtime_machine.py``) covers the protocol without faults;
this one drives random fault plans through the same actors.
"""

from __future__ import annotations

from hypothesis import event, given
from hypothesis import strategies as st

from runtime.backends.simulated import greedy_continuation
from runtime.kernel.supervision import RestartPolicy
from runtime.messages import (
    Cancel,
    Cancelled,
    Failed,
    Finished,
    ModelLoaded,
    ModelSpec,
    Rejected,
    TokensEmitted,
)
from runtime.testing.faults import FaultKind, FaultPlan
from runtime.testing.harness import engines, kv_keeper, make_sim, prefix_cache, router, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

STEP_TIMEOUT_S = 1.0
PER_TOKEN = 0.001
RETRYABLE_FAILURES = {
    "backend_error",
    "kv_budget_exhausted",
    "step_timeout",
    "engine_crashed",
    "engine_process_lost",  # a LOSE fault: the engine's process died
}
REFUSALS = {"model_restarting", "model_failed"}

requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, 255), min_size=1, max_size=60).map(tuple),
        st.integers(1, 6),  # max_tokens
        st.booleans(),  # cancel it part-way
        st.sampled_from([0.005, 0.5, 1.5]),  # virtual seconds before the next one
    ),
    min_size=1,
    max_size=5,
)


def model_spec(trimmable: bool) -> ModelSpec:
    return sim_spec(
        chunk=16,
        trimmable=trimmable,
        fixed_state_bytes=0 if trimmable else 2048,
        prefill_s_per_token=PER_TOKEN,
        decode_s_per_token=PER_TOKEN,
    )


def make(seed: int, rate: float, kinds: list[FaultKind], trimmable: bool) -> Simulator:
    """Model "m" loaded without faults; from then on the plan injects them (a slow step
    overruns the watchdog's limit)."""
    plan = FaultPlan(seed=seed, rate=rate, kinds=kinds, slow_s=2 * STEP_TIMEOUT_S)
    plan.disable()
    sim = make_sim(
        model_spec(trimmable),
        seed=seed,
        faults=plan,
        step_timeout_s=STEP_TIMEOUT_S,
        engine_restart=RestartPolicy(max_restarts=2, within_s=30.0),
    )
    plan.enable()
    return sim


def assert_nothing_is_held(sim: Simulator) -> None:
    assert router(sim).live_sequences() == {}
    assert all(core.statistics().gauges["sequences"] == 0 for core in engines(sim))
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


@given(
    seed=st.integers(0, 2**16),
    rate=st.sampled_from([0.05, 0.2, 0.5]),
    kinds=st.lists(st.sampled_from(list(FaultKind)), min_size=1, unique=True),
    trimmable=st.booleans(),
    sent=requests,
)
def test_every_request_ends_once_and_everything_is_given_back_under_faults(
    seed: int,
    rate: float,
    kinds: list[FaultKind],
    trimmable: bool,
    sent: list[tuple[tuple[int, ...], int, bool, float]],
) -> None:
    sim = make(seed, rate, kinds, trimmable)
    for i, (prompt, n, cancel, pause_s) in enumerate(sent):
        sim.send(generate(f"r{i}", prompt, n))
        sim.advance(0.005)
        if cancel:
            sim.send(Cancel(request_id=f"r{i}", incarnation=1))
        sim.advance(pause_s)  # later requests may find the model reloading, or failed
    sim.run_until_quiescent()
    assert sim.faults is not None
    event(f"faults injected: {min(len(sim.faults.injected), 3)}+")

    # Safety: exactly one terminal each, nothing after it; failures say to retry.
    for i, (prompt, n, _, _) in enumerate(sent):
        events = sim.events(f"r{i}", 1)
        ends = [e for e in events if isinstance(e, Finished | Cancelled | Failed | Rejected)]
        assert len(ends) == 1 and events[-1] is ends[0], events
        end = ends[0]
        event(f"a request ended {getattr(end, 'code', type(end).__name__)}")
        if isinstance(end, Failed):
            assert end.code in RETRYABLE_FAILURES and end.retryable, end
        if isinstance(end, Rejected):
            assert end.code in REFUSALS, end
        if isinstance(end, Finished):  # faults never change what a request that finished got
            shown = [t for e in events if isinstance(e, TokensEmitted) for t in e.token_ids]
            assert shown == greedy_continuation(prompt, n)
    assert_nothing_is_held(sim)

    # Liveness: with faults off the model serves again (loaded again if it was failed).
    sim.faults.disable()
    if router(sim).statistics().gauges["models_failed"]:
        assert isinstance(sim.load(model_spec(trimmable)), ModelLoaded)
    sim.run_until_quiescent()  # a reload under way ends
    prompt = tuple(range(1, 20))
    sim.send(generate("after", prompt, 3))
    sim.run_until_quiescent()
    assert isinstance(sim.terminal("after", 1), Finished)
    assert sim.emitted_tokens("after", 1) == greedy_continuation(prompt, 3)
    assert_nothing_is_held(sim)
