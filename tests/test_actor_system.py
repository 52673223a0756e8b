"""The production transport: mailboxes, ask/tell, stop ordering, supervision."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

import anyio
import pytest
from anyio.abc import TaskGroup

from runtime.errors import ActorStopped, SupervisionEscalated
from runtime.kernel.actor import ActorSystem
from runtime.kernel.core import Address, Context
from runtime.kernel.supervision import RestartPolicy, RestartTracker
from runtime.messages import GetStats, Message, Shutdown, Stats
from runtime.testing.harness import wait_until

pytestmark = pytest.mark.anyio


class Echo:
    """Replies to GetStats with how many messages it handled; crashes when told to."""

    def __init__(self, crash_on: int = 0) -> None:
        self.handled = 0
        self.crash_on = crash_on
        self.recovered = 0
        self.stopped = False

    def on_start(self, ctx: Context) -> None:
        pass

    def on_stop(self, ctx: Context) -> None:
        self.stopped = True

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        self.handled += 1
        if self.crash_on and self.handled % self.crash_on == 0:
            raise RuntimeError("boom")
        ctx.send(sender, Stats(actor="echo", counters={"handled": self.handled}))

    def crashed(self, error: BaseException, ctx: Context) -> None:
        self.recovered += 1


async def test_ask_gets_the_reply_and_stop_handles_earlier_mail_first() -> None:
    async with anyio.create_task_group() as tg:
        system = ActorSystem(tg)
        echo = Echo()
        system.spawn("echo", echo)
        reply = await system.ask("echo", GetStats())
        assert reply == Stats(actor="echo", counters={"handled": 1})
        for _ in range(5):
            system.tell("echo", GetStats(), sender="nobody")
        system.stop("echo")
        with pytest.raises(ActorStopped):
            await system.ask("echo", GetStats())
        await wait_until(system, lambda: echo.stopped, timeout=5)
        assert echo.handled == 6 and echo.stopped
        assert system.dead_letters["no_actor:Stats"] == 5


async def test_wait_progress_returns_once_a_message_was_handled_and_once_an_actor_stopped() -> None:
    async with anyio.create_task_group() as tg:
        system = ActorSystem(tg)
        echo = Echo()
        system.spawn("echo", echo)
        with anyio.fail_after(5):
            system.tell("echo", GetStats(), sender="nobody")
            await system.wait_progress()
            assert (echo.handled, echo.stopped) == (1, False)
            system.stop("echo")
            await system.wait_progress()
            assert echo.stopped and system.addresses() == []


async def test_a_crash_within_intensity_is_recovered() -> None:
    async with anyio.create_task_group() as tg:
        system = ActorSystem(tg)
        echo = Echo(crash_on=2)
        system.spawn("echo", echo, policy=RestartPolicy(max_restarts=3, within_s=60))
        await system.ask("echo", GetStats())
        system.tell("echo", GetStats(), sender="nobody")  # crashes, recovered
        reply = await system.ask("echo", GetStats())
        assert reply == Stats(actor="echo", counters={"handled": 3})
        assert echo.recovered == 1
        system.stop("echo")


async def test_crashes_beyond_intensity_escalate() -> None:
    with pytest.raises(BaseExceptionGroup) as raised:
        async with anyio.create_task_group() as tg:
            system = ActorSystem(tg)
            system.spawn("echo", Echo(crash_on=1), policy=RestartPolicy(max_restarts=1))
            for _ in range(3):
                system.tell("echo", GetStats(), sender="nobody")
    assert raised.group_contains(SupervisionEscalated)


def test_restart_tracker_forgets_old_crashes() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=2, within_s=10))
    assert tracker.may_restart(0) and tracker.may_restart(1)
    assert not tracker.may_restart(2)
    assert tracker.may_restart(30)  # the window moved on


class StuckWorker:
    """Computes a job that blocks until ``release`` is set; on ``Shutdown`` gives it up and
    computes once more."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release
        self.done: list[Message] = []
        self.stopped = False

    def on_start(self, ctx: Context) -> None:
        ctx.compute(self.release.wait, GetStats())  # never returns until released
        ctx.compute(lambda: None, GetStats())  # queued behind it

    def on_stop(self, ctx: Context) -> None:
        self.stopped = True

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        if isinstance(message, Shutdown):
            ctx.abandon_compute()
            ctx.compute(lambda: None, Stats(actor="fresh", counters={}))  # a fresh executor
        else:
            self.done.append(message)


async def test_abandoned_compute_is_not_waited_for_and_later_jobs_run_on_a_fresh_thread() -> None:
    release = threading.Event()
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                system = ActorSystem(tg)
                worker = StuckWorker(release)
                system.spawn("worker", worker, computes=True)
                system.tell("worker", Shutdown(), sender="test")
                await wait_until(system, lambda: bool(worker.done))
                assert worker.done == [Stats(actor="fresh", counters={})]
                system.stop("worker")  # does not wait for the stuck thread
                await wait_until(system, lambda: worker.stopped)
                assert system.dead_letters["abandoned_compute:GetStats"] == 1  # the queued one
    finally:
        release.set()


class GatedTaskGroup:
    """Starts tasks that wait for ``go`` first: the test decides when a mailbox loop starts."""

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        self.go = anyio.Event()

    def start_soon(
        self, fn: Callable[..., Awaitable[object]], *args: object, name: object = None
    ) -> None:
        async def gated() -> None:
            await self.go.wait()
            await fn(*args)

        self._tg.start_soon(gated, name=name)


class Witness(Echo):
    """An Echo that notes, for each message it takes, whether ``done`` was already set."""

    def __init__(self, done: anyio.Event) -> None:
        super().__init__()
        self.done = done
        self.done_when_taken: list[bool] = []

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        self.done_when_taken.append(self.done.is_set())
        super().handle(message, sender, ctx)


async def test_the_host_edge_waits_while_a_mailbox_is_full_until_one_message_is_taken() -> None:
    async with anyio.create_task_group() as tg:
        gate = GatedTaskGroup(tg)
        system = ActorSystem(gate)  # type: ignore[arg-type]
        sent = anyio.Event()
        witness = Witness(done=sent)
        system.spawn("echo", witness, capacity=2)  # its mailbox loop waits for gate.go

        async def send_one_more() -> None:
            await system.tell_external("echo", GetStats(), sender="nobody")
            sent.set()

        with anyio.fail_after(5):
            for _ in range(2):  # room for both: neither waits
                await system.tell_external("echo", GetStats(), sender="nobody")
            tg.start_soon(send_one_more)
            await anyio.wait_all_tasks_blocked()
            assert not sent.is_set()  # at capacity and nothing taken: the sender waits
            assert witness.handled == 0
            gate.go.set()
            await sent.wait()
            await wait_until(system, lambda: witness.handled == 3)
        # The send went through once the first message was taken, before the second was.
        assert witness.done_when_taken == [False, True, True]
        system.stop("echo")
