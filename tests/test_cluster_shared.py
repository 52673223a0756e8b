"""Two Runtimes of one process on the local Ray the first one started (in a fresh interpreter, so
that no other test's Ray is there): the second joins it; the first leaving does not stop Ray
under the second, which serves on; the last one leaving stops it."""

from __future__ import annotations

import pytest

from tests.fresh_process import run_script

pytest.importorskip("ray")

pytestmark = [pytest.mark.cluster, pytest.mark.mlx]

SCRIPT = """
import anyio, ray
from runtime import ClusterConfig, ModelSpec, Runtime, RuntimeConfig

CONFIG = RuntimeConfig(kv_budget_bytes=1 << 28, cluster=ClusterConfig(num_cpus=2))
SPEC = ModelSpec(name="llama", path=PATH)

class Held:
    # One Runtime in a task of its own, so that the two can leave in any order.
    def __init__(self):
        self.runtime = None
        self.entered, self.leave, self.gone = anyio.Event(), anyio.Event(), anyio.Event()

    async def hold(self):
        async with Runtime(CONFIG) as rt:
            self.runtime = rt
            self.entered.set()
            await self.leave.wait()
        self.gone.set()

async def main():
    starter, joiner = Held(), Held()
    with anyio.fail_after(240):
        async with anyio.create_task_group() as tg:
            tg.start_soon(starter.hold)
            await starter.entered.wait()  # it started the local Ray
            tg.start_soon(joiner.hold)
            await joiner.entered.wait()  # it joined it
            await starter.runtime.load_model(SPEC)
            starter.leave.set()  # the one that started Ray leaves first
            await starter.gone.wait()
            assert ray.is_initialized(), "the first Runtime stopped Ray under the second"
            await joiner.runtime.load_model(SPEC)
            done = await joiner.runtime.complete("llama", "Hello", max_tokens=3)
            assert done.usage.completion_tokens == 3, done
            joiner.leave.set()
    assert not ray.is_initialized(), "the last Runtime left Ray running"
    print("ok")

anyio.run(main)
"""


def test_runtimes_of_one_process_share_the_ray_the_first_started() -> None:
    done = run_script(SCRIPT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
