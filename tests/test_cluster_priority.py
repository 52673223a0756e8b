"""An engine process computes at the host's CPU priority, not at the lower one Ray gives its
workers by default (``worker_niceness`` 15): on a busy machine a niced engine's prefills lose the
CPU to other work, which put the Ray engine's time to first token ~15-35 ms above the in-process
one on SmolLM2 (docs/cluster.md, "Figures").

The runtime half runs in a fresh interpreter that first sets its niceness to 0, so that the
check holds whatever priority the test run itself has (tests run niced, and a niced host's
workers are niced as far as they go anyway); where lowering a niceness is not permitted (no
CAP_SYS_NICE) it is skipped.
"""

from __future__ import annotations

import pytest

from runtime.cluster.proxy import niceness_note
from tests.fresh_process import run_script

SCRIPT = """
import os
try:
    os.setpriority(os.PRIO_PROCESS, 0, 0)  # this thread; Ray's processes start from it
except PermissionError:
    print("no permission")
    raise SystemExit(0)
import anyio
from runtime import ClusterConfig, ModelSpec, Runtime, RuntimeConfig

CONFIG = RuntimeConfig(kv_budget_bytes=1 << 28, cluster=ClusterConfig(num_cpus=2))

async def main():
    with anyio.fail_after(240):
        async with Runtime(CONFIG) as rt:
            await rt.load_model(ModelSpec(name="llama", path=PATH))
            engine = next(s for a, s in rt.stats().actors.items() if a.startswith("engine:"))
            print("niceness", os.nice(0), engine.gauges["process_niceness"])

anyio.run(main)
"""


@pytest.mark.cluster
@pytest.mark.mlx
def test_an_engine_process_runs_at_the_hosts_niceness() -> None:
    pytest.importorskip("ray")
    done = run_script(SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip() == "no permission":
        pytest.skip("lowering a niceness needs CAP_SYS_NICE here")
    assert done.stdout.split()[-3:] == ["niceness", "0", "0"], done.stdout


def test_a_niced_engine_is_named_and_an_equal_one_is_not() -> None:
    note = niceness_note(15, 0)
    assert note is not None and "niceness 15" in note and "RAY_worker_niceness=0" in note
    assert niceness_note(19, 19) is None
    assert niceness_note(0, 5) is None
