"""Engines as Ray actors (runtime/cluster/), on a local Ray with two CPUs and the tiny llama.

One Ray per module (starting it costs seconds on this machine); every test starts its own
Runtime on it. What is checked: a Ray engine streams what an in-process one does, with the same
reuse; its process, killed mid-stream, ends the stream with a typed retryable error, the model
comes back in a new process and the keeper's books balance; a stuck engine is killed by the
watchdog; bad cluster input is a typed error at once, never a hang.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import anyio
import msgspec
import pytest

from runtime.backends.loader import make_backend_loader
from runtime.cluster.options import ClusterConfig
from runtime.errors import ClusterResourcesMissing, ClusterUnavailable
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.supervision import RestartPolicy
from runtime.messages import Failed, Finished, ModelSpec, Started, TokensEmitted
from runtime.testing.faults import Fault, FaultKind, FaultPlan, FaultPoint
from runtime.testing.harness import wait_until
from runtime.testing.tiny_models import tiny_model_path
from tests.loop_checks import LoopBackend, on_asyncio

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.mlx]

PROMPT = "The weather today is"
CLUSTER = ClusterConfig(num_cpus=2, placement_timeout_s=60)


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    return on_asyncio()  # one loop: each Ray test costs seconds here


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    from runtime.cluster.connect import connect

    link = connect(CLUSTER)
    yield
    link.close()


def llama() -> ModelSpec:
    return ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")


def config(**fields: object) -> RuntimeConfig:
    return RuntimeConfig(kv_budget_bytes=1 << 28, cluster=CLUSTER, **fields)  # type: ignore[arg-type]


def engine_pid(rt: Runtime) -> int:
    engines = [s for a, s in rt.stats().actors.items() if a.startswith("engine:")]
    assert len(engines) == 1
    return engines[0].gauges["process_id"]


def books_balance(rt: Runtime) -> bool:
    """At quiescence the keeper holds exactly the bytes of live prefix entries."""
    actors = rt.stats().actors
    return actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]


def reloaded(rt: Runtime, failures: int) -> bool:
    router = rt.stats().actors["router"]
    return router.counters.get("engines_failed", 0) == failures and not (
        router.gauges["models_restarting"] or router.gauges["models_loading"]
    )


async def two_turns(rt: Runtime) -> list[tuple[str, int]]:
    await rt.load_model(llama())
    out = []
    for prompt in (PROMPT, PROMPT + " sunny and warm"):
        done = await rt.complete("llama", prompt, max_tokens=8)
        assert isinstance(done.terminal, Finished)
        out.append((done.text, done.usage.cached_prompt_tokens))
    return out


async def test_a_ray_engine_streams_what_an_in_process_engine_does() -> None:
    with anyio.fail_after(120):
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
            local = await two_turns(rt)
        async with Runtime(config()) as rt:
            remote = await two_turns(rt)
            assert engine_pid(rt) not in (0, os.getpid())  # it ran in a process of its own
    assert remote == local
    assert local[1][1] > 0  # the second turn reused the first one's prefix


def crossings(rt: Runtime) -> tuple[int, int]:
    """(Ray calls, messages in them) the engine's proxy has sent the engine's process."""
    engines = [s for a, s in rt.stats().actors.items() if a.startswith("engine:")]
    counters = engines[0].counters
    return counters.get("transport_calls_out", 0), counters.get("transport_messages_out", 0)


async def test_a_requests_admission_crosses_to_its_engine_in_two_ray_calls() -> None:
    """Admit, then the KV grant with the prefix lookup's answer (runtime/cluster/inbox.py): a
    round trip more on a request's way to its first token fails this. The prefill hangs, so
    nothing else crosses before the counts are read; killing the process then ends it."""
    plan = FaultPlan(Fault(FaultPoint.PREFILL, FaultKind.HANG))
    loader = plan.wrap_loader(make_backend_loader())
    once = config(engine_restart=RestartPolicy(max_restarts=0))
    with anyio.fail_after(120):
        async with Runtime(once, load_backend=loader) as rt:
            await rt.load_model(llama())
            before = after = crossings(rt)
            stream = rt.generate("llama", PROMPT, max_tokens=4)
            async with stream:
                async for event in stream:
                    if isinstance(event, Started):  # restored: its prefill hangs
                        after = crossings(rt)
                        os.kill(engine_pid(rt), signal.SIGKILL)
                        break
    calls, messages = after[0] - before[0], after[1] - before[1]
    assert (calls, messages) == (2, 3)  # [Admit], [Reserved, LookupResult]


async def test_a_killed_engine_process_ends_its_stream_and_the_model_comes_back() -> None:
    with anyio.fail_after(180):
        async with Runtime(config()) as rt:
            await rt.load_model(llama())
            first = engine_pid(rt)
            stream = rt.generate("llama", PROMPT, max_tokens=1500)
            async with stream:
                async for event in stream:
                    if isinstance(event, TokensEmitted):
                        os.kill(first, signal.SIGKILL)  # mid-stream, as the OOM killer would
                        break
                terminal = [e async for e in stream][-1]
            assert isinstance(terminal, Failed)
            assert terminal.code == "engine_process_lost" and terminal.retryable
            await wait_until(rt, lambda: reloaded(rt, 1), timeout=120)
            assert engine_pid(rt) not in (0, first)
            assert books_balance(rt)  # the lost epoch's reservations and entries were released
            assert rt.stats().actors["prefix"].counters["invalidations"] == 1
            done = await rt.complete("llama", PROMPT, max_tokens=4)
            assert isinstance(done.terminal, Finished)


async def test_the_watchdog_kills_a_stuck_engine_process_and_the_model_comes_back() -> None:
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG, after=2))
    loader = plan.wrap_loader(make_backend_loader())  # shipped to the engine's process
    with anyio.fail_after(180):
        async with Runtime(config(step_timeout_s=2.0), load_backend=loader) as rt:
            await rt.load_model(llama())
            stuck_pid = engine_pid(rt)
            stuck = await rt.complete("llama", PROMPT, max_tokens=8)
            assert isinstance(stuck.terminal, Failed)
            assert stuck.terminal.code == "step_timeout" and stuck.terminal.retryable
            await wait_until(rt, lambda: reloaded(rt, 1), timeout=120)
            assert engine_pid(rt) != stuck_pid
            await process_gone(stuck_pid)  # the stuck thread died with its process
            assert books_balance(rt)


def replica_pids(rt: Runtime) -> dict[str, int]:
    return {
        address: stats.gauges["process_id"]
        for address, stats in rt.stats().actors.items()
        if address.startswith("engine:")
    }


async def test_two_replicas_in_two_processes_one_killed_the_other_serves_on() -> None:
    with anyio.fail_after(180):
        async with Runtime(config()) as rt:
            loaded = await rt.load_model(msgspec.structs.replace(llama(), replicas=2))
            assert loaded.model == "llama"
            pids = replica_pids(rt)
            assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
            doomed = rt.generate("llama", PROMPT, max_tokens=1500, session="a")
            async with doomed:
                async for event in doomed:
                    if isinstance(event, TokensEmitted):
                        break
                live = {a: s.gauges.get("sequences", 0) for a, s in rt.stats().actors.items()
                        if a.startswith("engine:")}  # fmt: skip
                busy = max(live, key=lambda a: live[a])
                os.kill(pids[busy], signal.SIGKILL)
                other = await rt.complete("llama", PROMPT + " again", max_tokens=6, session="b")
                terminal = [e async for e in doomed][-1]
            assert isinstance(terminal, Failed) and terminal.code == "engine_process_lost"
            assert isinstance(other.terminal, Finished)  # the other replica served meanwhile
            await wait_until(rt, lambda: reloaded(rt, 1), timeout=120)
            assert books_balance(rt)
            assert len(replica_pids(rt)) == 2 and pids[busy] not in replica_pids(rt).values()


async def test_requests_a_killed_replica_had_not_started_are_served_by_the_other() -> None:
    one_at_a_time = msgspec.structs.replace(llama(), replicas=2, options={"max_concurrent": 1})
    with anyio.fail_after(180):
        async with Runtime(config()) as rt:
            await rt.load_model(one_at_a_time)
            pids = replica_pids(rt)
            running = rt.generate("llama", PROMPT, max_tokens=1500, session="s")
            async with running:
                async for event in running:
                    if isinstance(event, TokensEmitted):
                        break
                # Same session, same replica: it waits behind the running one, not started.
                async with anyio.create_task_group() as tg:
                    waiting: list[object] = []

                    async def wait_for_it() -> None:
                        done = await rt.complete(
                            "llama", PROMPT + " too", max_tokens=4, session="s"
                        )
                        waiting.append(done.terminal)

                    tg.start_soon(wait_for_it)
                    await wait_until(rt, lambda: router_live(rt) == 2)
                    os.kill(pids[busy_engine(rt)], signal.SIGKILL)
                terminal = [e async for e in running][-1]
            assert isinstance(terminal, Failed) and terminal.code == "engine_process_lost"
            assert isinstance(waiting[0], Finished)  # moved to the other replica, served there
            assert rt.stats().actors["router"].counters["requests_moved"] == 1


def busy_engine(rt: Runtime) -> str:
    """The one engine holding sequences (its counts come with its process's last mail)."""
    actors = rt.stats().actors.items()
    (busy,) = [a for a, s in actors if a.startswith("engine:") and s.gauges.get("sequences")]
    return busy


def router_live(rt: Runtime) -> int:
    return rt.stats().actors["router"].gauges["live_requests"]


async def process_gone(pid: int) -> None:
    """Wait for an OS process to exit: its pidfd (Linux) turns readable then, zombie or not."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    try:
        with anyio.fail_after(30):
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)


async def test_more_than_the_cluster_has_is_a_typed_error_naming_the_resource() -> None:
    greedy = ClusterConfig(num_cpus=2, engine_num_cpus=3)
    with anyio.fail_after(60):
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28, cluster=greedy)) as rt:
            with pytest.raises(ClusterResourcesMissing, match=r"3 CPU.*has 2"):
                await rt.load_model(llama())
    with anyio.fail_after(60):
        async with Runtime(config()) as rt:  # one CPU each, three replicas, two CPUs
            with pytest.raises(ClusterResourcesMissing, match=r"3 engine.*3 CPU.*has 2"):
                await rt.load_model(msgspec.structs.replace(llama(), replicas=3))
            assert not [s for s in await rt.list_models() if s.state != "unloading"]
    custom = ClusterConfig(engine_resources={"mac_studio": 1})
    with anyio.fail_after(60):
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28, cluster=custom)) as rt:
            with pytest.raises(ClusterResourcesMissing, match="mac_studio"):
                await rt.load_model(llama())


async def test_an_unreachable_ray_address_is_a_typed_error_at_start() -> None:
    unreachable = ClusterConfig(address="127.0.0.1:1", connect_timeout_s=5)
    with anyio.fail_after(30), pytest.raises(ClusterUnavailable, match=r"127\.0\.0\.1:1"):
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28, cluster=unreachable)):
            pass
    with pytest.raises(ClusterUnavailable, match="HOST:PORT"):
        async with Runtime(RuntimeConfig(cluster=ClusterConfig(address="nowhere"))):
            pass
