"""Idle housekeeping (``Backend.tidy``, actors/engine/tidying.py) on the simulator, in virtual
time: it runs only once the engine has idled ``TIDY_AFTER_S``, piece by piece until the backend
has nothing left; a request sent sooner finds none of it in its way, one sent later waits behind
at most one piece; a piece that raises stops it and nothing else. The llama.cpp backend's own
``tidy`` (spilling ahead of need) is tested on the real binding in test_llamacpp_backend.py."""

from __future__ import annotations

from actors.engine.tidying import TIDY_AFTER_S
from runtime.backends.simulated import greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.messages import Finished, ModelLoaded, ModelUnloaded, UnloadModel
from runtime.testing.faults import Fault, FaultPlan, FaultPoint
from runtime.testing.harness import ModelOption, engine, kv_keeper, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

PROMPT = tuple(range(1, 21))


def start(faults: FaultPlan | None = None, **options: ModelOption) -> Simulator:
    given: dict[str, ModelOption] = {
        "prefill_s_per_token": 0.001,
        "decode_s_per_token": 0.001,
        "tidy_pieces": 3,
        "tidy_step_s": 0.01,
    }
    sim = Simulator(config=RuntimeConfig(kv_budget_bytes=1 << 30), faults=faults)
    assert isinstance(sim.load(sim_spec("m", chunk=8, **(given | options))), ModelLoaded)
    return sim


def serve(sim: Simulator, request_id: str, prompt: tuple[int, ...] = PROMPT) -> None:
    sim.send(generate(request_id, prompt, 4))  # fmt: skip
    sim.run_until(lambda: sim.terminal(request_id, 1) is not None)
    assert isinstance(sim.terminal(request_id, 1), Finished), sim.terminal(request_id, 1)
    assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, 4)


def pieces(sim: Simulator) -> int:
    return engine(sim).counters.snapshot().get("tidy_pieces", 0)


def test_an_idle_engine_tidies_every_piece_then_stops_until_work_runs_again() -> None:
    sim = start()
    serve(sim, "a")
    assert pieces(sim) == 0  # the reply came first
    # Due within two TIDY_AFTER_S: a timer armed before the request may still sleep (one at a
    # time), and the period after the reply arms its own once that one has fired.
    sim.advance(2 * TIDY_AFTER_S + 0.1)
    assert pieces(sim) == 3
    sim.advance(10.0)  # nothing left: no timer, no piece, however long it idles
    assert pieces(sim) == 3
    serve(sim, "b")  # its prefill leaves three more
    sim.run_until_quiescent()
    assert pieces(sim) == 6


def test_a_request_sent_right_after_a_reply_finds_no_housekeeping_in_its_way() -> None:
    sim = start()
    serve(sim, "a")
    sim.advance(TIDY_AFTER_S / 2)
    serve(sim, "b", tuple(range(30, 50)))
    assert pieces(sim) == 0
    sim.run_until_quiescent()
    assert pieces(sim) == 3  # after b, idle at last
    assert sim.dead_letters["stale_tidy_timer"] >= 1  # the timer armed after a, fired late


def test_a_request_waits_behind_at_most_the_piece_already_running() -> None:
    sim = start(tidy_pieces=5, tidy_step_s=1.0)  # a piece costs as much as 1,000 tokens' work
    serve(sim, "a")
    sim.advance(2 * TIDY_AFTER_S + 0.5)  # the first piece runs
    serve(sim, "b", tuple(range(30, 50)))
    assert pieces(sim) == 1
    sim.run_until_quiescent()
    assert pieces(sim) == 1 + 5  # b's prefill left five anew: the rest of a's four never ran


def test_a_piece_that_raises_stops_tidying_and_nothing_else() -> None:
    sim = start(faults=FaultPlan(Fault(FaultPoint.TIDY, after=0)))
    serve(sim, "a")
    sim.run_until_quiescent()
    counters = engine(sim).counters.snapshot()
    assert counters["tidy_failed"] == 1 and counters.get("tidy_pieces", 0) == 0
    serve(sim, "b", tuple(range(30, 50)))  # served as before, and no piece is tried again
    sim.run_until_quiescent()
    assert engine(sim).counters.snapshot()["tidy_failed"] == 1


def test_an_unload_while_housekeeping_is_due_drains_without_it() -> None:
    sim = start(tidy_pieces=50, tidy_step_s=0.5)
    serve(sim, "a")
    assert isinstance(sim.ask(UnloadModel(model="m")), ModelUnloaded)
    assert kv_keeper(sim).reserved_bytes == 0
