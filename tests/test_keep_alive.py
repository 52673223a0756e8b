"""Keep-alive and auto-load in the router, on the simulator (virtual time, simulated models)."""

from __future__ import annotations

import itertools
import math

import msgspec
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.errors import InvalidModelSpec, ModelAlreadyLoaded, ModelLoading, ModelNotLoaded
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancel,
    Cancelled,
    CommandFailed,
    Failed,
    Finished,
    ListModels,
    LoadModel,
    ModelLoaded,
    ModelsListed,
    ModelSpec,
    ModelStatus,
    ModelUnloaded,
    Rejected,
    Started,
    UnloadModel,
)
from runtime.testing.harness import kv_keeper, make_sim, router, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

PROMPT = (5, 6, 7, 8, 9, 10)
_incarnations = itertools.count(1)


def spec(keep_alive_s: float | None = 10.0, **options: float | bool) -> ModelSpec:
    options = {"decode_s_per_token": 0.01, "bytes_per_token": 16, **options}
    return msgspec.structs.replace(sim_spec("m", chunk=4, **options), keep_alive_s=keep_alive_s)


def send(sim: Simulator, request_id: str = "r", max_tokens: int = 3) -> tuple[str, int]:
    incarnation = next(_incarnations)
    sim.send(generate(request_id, PROMPT, max_tokens, incarnation=incarnation))
    return request_id, incarnation


def status(sim: Simulator, name: str = "m") -> ModelStatus | None:
    reply = sim.ask(ListModels())
    assert isinstance(reply, ModelsListed)
    return next((s for s in reply.models if s.name == name), None)


def finished_with_greedy_tokens(sim: Simulator, key: tuple[str, int], n: int) -> None:
    terminal = sim.terminal(*key)
    assert isinstance(terminal, Finished), sim.events(*key)
    assert sim.emitted_tokens(*key) == greedy_continuation(list(PROMPT), n)


def started_epoch(sim: Simulator, key: tuple[str, int]) -> int:
    [started] = [e for e in sim.events(*key) if isinstance(e, Started)]
    return started.epoch


def router_counter(sim: Simulator, name: str) -> int:
    return router(sim).counters.snapshot().get(name, 0)


def send_as_the_idle_unload_starts(
    sim: Simulator, request_id: str, *, cancel: bool = False
) -> tuple[str, int]:
    """Run until the router has just handled the keep-alive's ``IdleCheck`` (the model drains
    still) and send a request then (and its ``Cancel`` right behind it); its key."""
    sent: list[tuple[str, int]] = []

    def send_once_unloading() -> None:
        if not sent and router_counter(sim, "models_idle_unloaded") == 1:
            assert router(sim).statistics().gauges["models"] == 1  # not drained yet
            sent.append(send(sim, request_id))
            if cancel:
                sim.send(Cancel(request_id=request_id, incarnation=sent[0][1]))

    sim.check_every_step(send_once_unloading)
    sim.run_until(lambda: bool(sent), max_seconds=100.0)
    return sent[0]


def test_an_idle_model_is_unloaded_after_its_keep_alive_and_its_kv_returns() -> None:
    sim = make_sim(spec(keep_alive_s=10.0))
    key = send(sim)
    sim.run_until(lambda: sim.terminal(*key) is not None)
    assert kv_keeper(sim).reserved_bytes > 0  # its prompt is cached as a prefix entry
    loaded = status(sim)
    assert loaded is not None and loaded.state == "loaded"
    assert loaded.expires_in_s is not None and 9.0 < loaded.expires_in_s <= 10.0
    sim.advance(9.0)
    assert status(sim).state == "loaded"  # type: ignore[union-attr]
    sim.advance(1.5)
    idle = status(sim)
    assert idle is not None and idle.state == "idle" and idle.live_requests == 0
    assert kv_keeper(sim).reserved_bytes == 0
    assert router_counter(sim, "models_idle_unloaded") == 1


def test_a_request_keep_alive_becomes_the_model_keep_alive_from_then_on() -> None:
    sim = make_sim(spec(keep_alive_s=10.0))
    incarnation = next(_incarnations)
    request = generate("short", PROMPT, 3, incarnation=incarnation, keep_alive_s=2.0)
    sim.send(request)
    sim.run_until(lambda: sim.terminal("short", incarnation) is not None)
    assert status(sim).keep_alive_s == 2.0  # type: ignore[union-attr]
    sim.advance(2.5)  # its own 10 s would keep it loaded
    assert status(sim).state == "idle"  # type: ignore[union-attr]
    forever = generate("forever", PROMPT, 3, incarnation=next(_incarnations), keep_alive_s=math.inf)
    sim.send(forever)  # loads it again, and from then on keeps it
    sim.run_until(lambda: sim.terminal("forever", forever.incarnation) is not None)
    sim.advance(1000.0)
    kept = status(sim)
    assert kept is not None and kept.state == "loaded" and kept.keep_alive_s is None


def test_a_request_in_flight_keeps_the_model_loaded_past_its_keep_alive() -> None:
    sim = make_sim(spec(keep_alive_s=0.05, decode_s_per_token=0.02))
    key = send(sim, max_tokens=20)  # ~0.4 s of decode: eight keep-alives long
    sim.run_until(lambda: sim.terminal(*key) is not None)
    finished_with_greedy_tokens(sim, key, 20)
    assert router_counter(sim, "models_idle_unloaded") == 0
    sim.advance(0.1)
    assert status(sim).state == "idle"  # type: ignore[union-attr]


def test_a_request_for_an_idle_model_loads_it_again_at_a_new_epoch() -> None:
    sim = make_sim(spec(keep_alive_s=1.0))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    sim.advance(2.0)
    assert status(sim).state == "idle"  # type: ignore[union-attr]
    second = send(sim, "b")
    assert status(sim).state in ("loading", "loaded")  # type: ignore[union-attr]
    sim.run_until(lambda: sim.terminal(*second) is not None)
    finished_with_greedy_tokens(sim, second, 3)
    assert started_epoch(sim, second) > started_epoch(sim, first)
    assert status(sim).state == "loaded"  # type: ignore[union-attr]


def test_a_request_that_meets_the_idle_unload_waits_for_the_reload() -> None:
    sim = make_sim(spec(keep_alive_s=1.0))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    second = send_as_the_idle_unload_starts(sim, "b")
    assert router_counter(sim, "requests_parked") == 1
    sim.run_until(lambda: sim.terminal(*second) is not None)
    finished_with_greedy_tokens(sim, second, 3)
    assert started_epoch(sim, second) > started_epoch(sim, first)


def test_a_parked_request_can_be_cancelled() -> None:
    sim = make_sim(spec(keep_alive_s=1.0))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    parked = send_as_the_idle_unload_starts(sim, "b", cancel=True)
    assert router_counter(sim, "requests_parked") == 1
    assert isinstance(sim.terminal(*parked), Cancelled)
    sim.run_until_quiescent()
    assert sim.events(*parked)[-1] == sim.terminal(*parked)  # nothing after its end
    assert status(sim).state == "idle"  # type: ignore[union-attr]


def test_a_request_before_the_timer_fires_makes_it_stale() -> None:
    sim = make_sim(spec(keep_alive_s=1.0))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    sim.advance(0.5)
    second = send(sim, "b")  # the first spell's timer fires while (or after) this one runs
    sim.run_until(lambda: sim.terminal(*second) is not None)
    sim.advance(0.6)
    # Two spells ended by a request: the one since the load, the one since "a" ended.
    assert router_counter(sim, "idle_checks_stale") == 2
    assert router_counter(sim, "models_idle_unloaded") == 0
    assert status(sim).state == "loaded"  # type: ignore[union-attr]
    assert started_epoch(sim, second) == started_epoch(sim, first)


def test_keep_alive_zero_unloads_as_soon_as_the_last_request_ends() -> None:
    sim = make_sim(spec(keep_alive_s=0.0))
    key = send(sim)
    sim.run_until(lambda: sim.terminal(*key) is not None)
    sim.advance(0.0)
    assert status(sim).state == "idle"  # type: ignore[union-attr]


def test_no_keep_alive_keeps_the_model_loaded() -> None:
    sim = make_sim(spec(keep_alive_s=None))
    key = send(sim)
    sim.run_until(lambda: sim.terminal(*key) is not None)
    sim.advance(10_000.0)
    loaded = status(sim)
    assert loaded is not None and loaded.state == "loaded" and loaded.expires_in_s is None


def test_without_auto_load_an_idle_model_is_refused() -> None:
    sim = make_sim(spec(keep_alive_s=1.0), auto_load=False)
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    sim.advance(2.0)
    second = send(sim, "b")
    sim.run_until_idle()
    refused = sim.terminal(*second)
    assert isinstance(refused, Rejected) and refused.code == ModelNotLoaded.code


def test_an_explicit_unload_forgets_the_model() -> None:
    sim = make_sim(spec(keep_alive_s=1.0))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    assert isinstance(sim.ask(UnloadModel(model="m")), ModelUnloaded)
    assert status(sim) is None
    second = send(sim, "b")
    sim.run_until_idle()
    assert isinstance(sim.terminal(*second), Rejected)


def test_a_request_sent_while_the_model_loads_waits_for_it() -> None:
    sim = make_sim()
    sim.send(LoadModel(spec=spec(load_s=2.0)), sender="host:loader")
    sim.run_until_idle()
    assert status(sim).state == "loading"  # type: ignore[union-attr]
    again = sim.ask(LoadModel(spec=spec()), max_seconds=0.0)
    assert isinstance(again, CommandFailed) and again.code == ModelLoading.code
    key = send(sim)
    sim.run_until(lambda: sim.terminal(*key) is not None)
    finished_with_greedy_tokens(sim, key, 3)


def test_requests_admitted_to_a_load_that_fails_end_with_its_failure() -> None:
    sim = make_sim()
    sim.send(LoadModel(spec=spec(load_s=1.0, fail_load=True)), sender="host:loader")
    sim.run_until_idle()
    key = send(sim)
    sim.run_until(lambda: sim.terminal(*key) is not None)
    failed = sim.terminal(*key)
    assert isinstance(failed, Failed) and not failed.retryable, failed
    assert status(sim) is None
    sim.run_until_quiescent()
    assert kv_keeper(sim).reserved_bytes == 0


def test_a_load_replaces_the_spec_of_an_idle_model() -> None:
    sim = make_sim(spec(keep_alive_s=1.0))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    sim.advance(2.0)
    reply = sim.load(spec(keep_alive_s=None))
    assert isinstance(reply, ModelLoaded)
    loaded = status(sim)
    assert loaded is not None and loaded.state == "loaded" and loaded.keep_alive_s is None


# --------------------------------------------------------------------------- on the Runtime


@pytest.mark.anyio
async def test_the_runtime_lists_its_models_and_refuses_a_bad_keep_alive() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        for bad in (-1.0, float("nan")):
            with pytest.raises(InvalidModelSpec, match="keep_alive_s"):
                await rt.load_model(spec(keep_alive_s=bad))
        assert await rt.list_models() == ()
        await rt.load_model(spec(keep_alive_s=None))
        [listed] = await rt.list_models()
        assert (listed.name, listed.state, listed.epoch, listed.live_requests) == (
            "m",
            "loaded",
            1,
            0,
        )
        assert listed.context_length == 4096 and listed.expires_in_s is None
        with pytest.raises(ModelAlreadyLoaded):
            await rt.load_model(spec())


def test_each_load_and_unload_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """issue 21: a keep-alive unload used to be silent; now the load, the idle unload and the
    reload a request brings are a line each, on the runtime's own logger."""
    caplog.set_level("INFO", logger="mlx_actor_runtime")
    sim = make_sim(spec(keep_alive_s=1.0, load_s=2.5))
    first = send(sim, "a")
    sim.run_until(lambda: sim.terminal(*first) is not None)
    sim.advance(2.0)
    second = send(sim, "b")
    sim.run_until(lambda: sim.terminal(*second) is not None)
    lines = [r.getMessage() for r in caplog.records if r.name == "mlx_actor_runtime.models"]
    assert len(lines) == 3, lines
    assert (
        lines[0].startswith("loaded m on simulated in 2.5 s (context")
        and "keep-alive 1 s" in lines[0]
    )
    assert lines[1].startswith("unloaded m (idle for its keep-alive of 1 s;")
    assert lines[2].startswith("loaded m on simulated in 2.5 s")
    assert all(r.levelname == "INFO" for r in caplog.records if r.name.endswith(".models"))
