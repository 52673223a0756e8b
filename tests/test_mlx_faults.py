"""A stuck step on the MLX backend (a tiny random-weight model, real compute thread): the watchdog
abandons the thread, which has used MLX, and the model reloads; once the hang is released the
thread finishes its job, releases its MLX streams and exits, so the process can exit too."""

from __future__ import annotations

import anyio
import pytest

from runtime.backends.loader import make_backend_loader
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Failed, Finished, ModelSpec
from runtime.testing.faults import Fault, FaultKind, FaultPlan, FaultPoint
from runtime.testing.harness import wait_until
from runtime.testing.tiny_models import tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


PROMPT = "The weather today is"


def model_reloaded(rt: Runtime) -> bool:
    router = rt.stats().actors["router"]
    return router.counters.get("engines_failed") == 1 and router.gauges["models_restarting"] == 0


async def test_a_stuck_mlx_step_is_abandoned_and_the_model_reloads() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG, after=2))  # after tokens were made
    loader = plan.wrap_loader(make_backend_loader())
    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    config = RuntimeConfig(kv_budget_bytes=1 << 28, step_timeout_s=2.0)
    try:
        with anyio.fail_after(120):
            async with Runtime(config, load_backend=loader) as rt:
                await rt.load_model(spec)
                stuck = await rt.complete("llama", PROMPT, max_tokens=8)
                assert isinstance(stuck.terminal, Failed)
                assert stuck.terminal.code == "step_timeout" and stuck.terminal.retryable
                await wait_until(rt, lambda: model_reloaded(rt), timeout=60)
                fine = await rt.complete("llama", PROMPT, max_tokens=4)
                assert isinstance(fine.terminal, Finished)
                assert fine.usage.completion_tokens == 4
                kv = rt.stats().actors["kv"].gauges["reserved"]
                assert kv == rt.stats().actors["prefix"].gauges["bytes"]
    finally:
        plan.release_hangs()
