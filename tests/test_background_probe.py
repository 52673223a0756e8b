"""A first load's probe run in the background (``MlxOptions.load_probe="background"``, the
default): the model is ready at once with every probed capability off, served exactly meanwhile,
and takes the verdict once the engine has run the probe's pieces while idle (actors/engine/
probing.py). On the simulator (virtual time, a simulated probe of several pieces) and on a tiny
real MLX model (the real probe, its verdict cached for the next load)."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from runtime.backends.contract import Capability
from runtime.backends.mlx.capabilities import PENDING
from runtime.backends.mlx.verdicts import probe_dir
from runtime.backends.simulated import greedy_continuation
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Finished,
    ListModels,
    ModelLoaded,
    ModelsListed,
    ModelSpec,
    ModelUnloaded,
    TokensEmitted,
    UnloadModel,
)
from runtime.testing.faults import Fault, FaultPlan, FaultPoint
from runtime.testing.harness import (
    ModelOption,
    engine,
    engine_stats,
    kv_keeper,
    prefix_cache,
    sim_spec,
    wait_until,
)
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


PER_TOKEN = 0.001
PROMPTS = (tuple(range(1, 41)), tuple(range(50, 80)), tuple(range(90, 101)))
CAPABILITIES = {str(c) for c in Capability}


def spec(**options: ModelOption) -> ModelSpec:
    given: dict[str, ModelOption] = {
        "prefill_s_per_token": PER_TOKEN,
        "decode_s_per_token": PER_TOKEN,
        "probe_steps": 3,
        "probe_step_s": 0.05,
    }
    return sim_spec("m", chunk=16, **(given | options))


def loaded(sim: Simulator, model_spec: ModelSpec) -> ModelLoaded:
    reply = sim.load(model_spec)
    assert isinstance(reply, ModelLoaded), reply
    return reply


def status_limits(sim: Simulator) -> dict[str, str]:
    listed = sim.ask(ListModels())
    assert isinstance(listed, ModelsListed)
    (status,) = listed.models
    return status.limits


def serve_together(sim: Simulator, *request_ids: str) -> None:
    """Send one generate per id at once; each ends with the cold greedy tokens."""
    for request_id, prompt in zip(request_ids, PROMPTS, strict=False):
        sim.send(generate(request_id, prompt, 6))
    sim.run_until_quiescent()
    for request_id, prompt in zip(request_ids, PROMPTS, strict=False):
        assert isinstance(sim.terminal(request_id, 1), Finished), sim.terminal(request_id, 1)
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, 6)


def test_a_pending_model_is_ready_limited_serves_alone_then_batches_after_its_probe() -> None:
    sim = Simulator(config=RuntimeConfig(kv_budget_bytes=1 << 30))
    reply = loaded(sim, spec())
    assert set(reply.limits) == CAPABILITIES  # every probed capability off, each saying why
    assert reply.reuse_path == "none"
    # Requests sent at once run while the probe is pending (the simulated backend raises on a
    # batched pass before the verdict: a failed request here would be that).
    serve_together(sim, "a", "b", "c")
    counters = engine(sim).counters.snapshot()
    assert counters.get("batch_steps", 0) == 0
    # Once idle, the engine ran the probe's three pieces: the model is as declared.
    assert counters["probe_pieces"] == 3
    assert engine(sim).statistics().gauges["probe_pending"] == 0
    assert status_limits(sim) == {}
    serve_together(sim, "d", "e", "f")
    assert engine(sim).counters.snapshot()["batch_steps"] > 0
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_each_probe_piece_waits_for_the_requests_that_are_ready() -> None:
    sim = Simulator(config=RuntimeConfig(kv_budget_bytes=1 << 30))
    loaded(sim, spec(probe_step_s=1.0))  # a piece costs as much as ~1,000 tokens' work
    sim.send(generate("a", PROMPTS[0], max_tokens=50))
    sim.run_until(lambda: sim.terminal("a", 1) is not None)
    # At most the piece already running when "a" arrived went ahead of it: the others waited.
    assert engine(sim).counters.snapshot().get("probe_pieces", 0) <= 1
    sim.run_until_quiescent()
    assert engine(sim).counters.snapshot()["probe_pieces"] == 3


def test_a_probe_piece_that_fails_leaves_the_model_limited_and_serving() -> None:
    plan = FaultPlan(Fault(FaultPoint.PROBE, after=1))
    sim = Simulator(config=RuntimeConfig(kv_budget_bytes=1 << 30), faults=plan)
    loaded(sim, spec())
    sim.run_until_quiescent()
    assert engine(sim).counters.snapshot()["probe_failed"] == 1
    assert engine(sim).statistics().gauges["probe_pending"] == 0  # not tried again
    assert set(status_limits(sim)) == CAPABILITIES
    serve_together(sim, "a", "b")
    assert engine(sim).counters.snapshot().get("batch_steps", 0) == 0


def test_an_unload_while_the_probe_is_pending_drains_without_running_it() -> None:
    sim = Simulator(config=RuntimeConfig(kv_budget_bytes=1 << 30))
    reply = loaded(sim, spec(probe_steps=50))
    assert isinstance(sim.ask(UnloadModel(model="m")), ModelUnloaded)
    assert kv_keeper(sim).reserved_bytes == 0
    del reply


# ---------------------------------------------------------------------- a real MLX model


@pytest.fixture
def own_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty probe cache: the load finds no verdict (tiny models are built elsewhere)."""
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


async def greedy(rt: Runtime, model: str, prompt: tuple[int, ...]) -> list[int]:
    async with rt.generate(model, prompt_tokens=prompt, max_tokens=8) as stream:
        return [t async for e in stream if isinstance(e, TokensEmitted) for t in e.token_ids]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["llama", "sliding"])
async def test_a_first_mlx_load_probes_in_the_background_and_caches_the_verdict(
    kind: TinyModelKind, own_cache_dir: Path
) -> None:
    path = str(tiny_model_path(kind))
    background = ModelSpec(name="t", path=path, options={"load_probe": "background"})
    at_load = ModelSpec(name="ref", path=path, options={"load_probe": "at_load"})
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 30)) as rt:
        reference = await rt.load_model(at_load)  # probes now (and caches the verdict)
        expected = [await greedy(rt, "ref", p) for p in PROMPTS]
        await rt.unload_model("ref")
        for verdict in probe_dir().glob("*.json"):  # the background load must probe anew
            verdict.unlink()
        pending = await rt.load_model(background)
        assert set(pending.limits) == CAPABILITIES
        assert all(why == PENDING for why in pending.limits.values())
        outputs: list[list[int]] = [[] for _ in PROMPTS]

        async def one(index: int) -> None:
            outputs[index] = await greedy(rt, "t", PROMPTS[index])

        async with anyio.create_task_group() as tg:  # while the probe is pending, or after
            for index in range(len(PROMPTS)):
                tg.start_soon(one, index)
        assert outputs == expected
        await wait_until(rt, lambda: engine_stats(rt, pending).gauges["probe_pending"] == 0)
        stats = engine_stats(rt, pending)
        assert stats.counters.get("probe_failed", 0) == 0
        (status,) = [m for m in await rt.list_models() if m.name == "t"]
        assert status.limits == reference.limits  # the verdict the at-load probe gave
        assert list(probe_dir().glob("*.json"))  # cached: the next load runs no probe
        await rt.unload_model("t")
        again = await rt.load_model(background)
        assert again.limits == reference.limits and again.reuse_path == reference.reuse_path
        assert engine_stats(rt, again).gauges["probe_pending"] == 0
