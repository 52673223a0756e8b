"""The production transport: actors as anyio tasks with mailboxes, compute threads and timers.

Each actor is a synchronous core (``runtime.kernel.core.ActorCore``) driven by one mailbox loop
here, the same loop for every actor, so the actor modules hold only state and decisions. Messages
travel in envelopes that carry the sender apart from the message (pykka's design), so replies need
no correlation fields in the messages themselves.

Mailboxes are unbounded for actor-to-actor traffic: two bounded mailboxes that send to each other
can deadlock. Backpressure applies at the edge instead: ``tell_external`` (the host's way in)
waits while the target's mailbox holds ``capacity`` messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from runtime.errors import ActorStopped, SupervisionEscalated
from runtime.kernel.core import ActorCore, Address
from runtime.kernel.supervision import RestartPolicy, RestartTracker
from runtime.messages import Message

log = logging.getLogger("mlx_actor_runtime.actor")

HostSink = Callable[[Message, Address], None]


@dataclass(frozen=True)
class Envelope:
    message: Message
    sender: Address


class _Stop:
    """Mailbox sentinel: stop after everything sent before it (stop is a message too)."""


_STOP = _Stop()


@dataclass
class _Actor:
    address: Address
    core: ActorCore
    send: MemoryObjectSendStream[Envelope | _Stop]
    receive: MemoryObjectReceiveStream[Envelope | _Stop]
    capacity: float
    policy: RestartPolicy
    computes: bool
    executor: ThreadPoolExecutor | None = None
    executor_generation: int = 0  # grows when its compute is abandoned: older jobs' ends drop
    io: ThreadPoolExecutor | None = None  # its I/O thread (``Context.background``), made at need
    space: anyio.Event | None = None
    pending_asks: dict[Address, anyio.Event] = field(default_factory=dict)
    stopped: bool = False


class _ActorContext:
    """``runtime.kernel.core.Context`` for one actor; effects run as soon as they are asked for."""

    def __init__(self, system: ActorSystem, actor: _Actor) -> None:
        self._system = system
        self._actor = actor

    @property
    def self_address(self) -> Address:
        return self._actor.address

    def now(self) -> float:
        return time.monotonic()

    def send(self, to: Address, message: Message) -> None:
        self._system.tell(to, message, sender=self._actor.address)

    def send_later(self, delay_s: float, message: Message) -> None:
        self._system.start_timer(delay_s, self._actor.address, message)

    def spawn(self, address: Address, core: ActorCore) -> None:
        self._system.spawn(address, core, policy=self._system.child_policy, computes=True)

    def stop(self, address: Address) -> None:
        self._system.stop(address)

    def compute(self, job: Callable[[], None], done: Message) -> None:
        self._system.run_compute(self._actor, job, done)

    def background(self, job: Callable[[], None], done: Message) -> None:
        self._system.run_background(self._actor, job, done)

    def abandon_compute(self) -> None:
        self._system.abandon_compute(self._actor)

    def count_dead_letter(self, reason: str) -> None:
        self._system.dead_letters[reason] += 1


class ActorSystem:
    """Owns every actor task of one runtime. Not global: each ``Runtime`` has its own."""

    def __init__(self, task_group: TaskGroup, child_policy: RestartPolicy | None = None) -> None:
        self._tg = task_group
        self.child_policy = child_policy or RestartPolicy()  # for actors that actors spawn
        self._actors: dict[Address, _Actor] = {}
        self._sinks: dict[Address, HostSink] = {}
        self._loop = asyncio.get_running_loop()
        self._next_ask = 0
        self._timers: set[anyio.CancelScope] = set()
        self._progress: anyio.Event | None = None  # made only while someone waits
        self.dead_letters: Counter[str] = Counter()

    # ------------------------------------------------------------------ actors

    def spawn(
        self,
        address: Address,
        core: ActorCore,
        *,
        capacity: float = math.inf,
        policy: RestartPolicy | None = None,
        computes: bool = False,
    ) -> None:
        if address in self._actors:
            raise ValueError(f"an actor already lives at {address!r}")
        send, receive = anyio.create_memory_object_stream[Envelope | _Stop](math.inf)
        actor = _Actor(address, core, send, receive, capacity, policy or RestartPolicy(), computes)
        if computes:
            actor.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=address)
        self._actors[address] = actor
        self._tg.start_soon(self._run, actor, name=f"actor {address}")

    def stop(self, address: Address) -> None:
        actor = self._actors.get(address)
        if actor is not None and not actor.stopped:
            actor.stopped = True
            actor.send.send_nowait(_STOP)

    def core(self, address: Address) -> ActorCore | None:
        actor = self._actors.get(address)
        return None if actor is None else actor.core

    def addresses(self) -> list[Address]:
        """Actors that are running and not stopping."""
        return [address for address, actor in self._actors.items() if not actor.stopped]

    def register_sink(self, address: Address, sink: HostSink) -> None:
        """Let a host-side callback receive messages sent to ``address`` (called on the loop)."""
        self._sinks[address] = sink

    def unregister_sink(self, address: Address) -> None:
        self._sinks.pop(address, None)

    async def wait_progress(self) -> None:
        """Wait until an actor next finishes handling a message, or stops.

        What actors hold changes only then, so a caller watching their state checks, waits here,
        and checks again instead of polling.
        """
        if self._progress is None:
            self._progress = anyio.Event()
        await self._progress.wait()

    def _progressed(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    # ------------------------------------------------------------------ delivery

    def tell(self, to: Address, message: Message, sender: Address) -> None:
        """Deliver without waiting; a message for nobody is dropped and counted."""
        sink = self._sinks.get(to)
        if sink is not None:
            sink(message, sender)
            return
        actor = self._actors.get(to)
        if actor is None or actor.stopped:
            self.dead_letters[f"no_actor:{type(message).__name__}"] += 1
            return
        actor.send.send_nowait(Envelope(message, sender))

    async def tell_external(self, to: Address, message: Message, sender: Address) -> None:
        """The host's way in: waits while ``to``'s mailbox is full; raises ``ActorStopped``."""
        actor = self._live(to)
        while actor.send.statistics().current_buffer_used >= actor.capacity:
            actor.space = actor.space or anyio.Event()
            await actor.space.wait()
            actor = self._live(to)
        actor.send.send_nowait(Envelope(message, sender))

    async def ask(self, to: Address, message: Message) -> Message:
        """Send and wait for the one reply; ``ActorStopped`` if ``to`` is gone or stops first."""
        self._next_ask += 1
        reply_to = f"ask:{self._next_ask}"
        replies: list[Message] = []
        arrived = anyio.Event()

        def receive(reply: Message, _sender: Address) -> None:
            replies.append(reply)
            arrived.set()

        actor = self._live(to)
        self.register_sink(reply_to, receive)
        actor.pending_asks[reply_to] = arrived
        try:
            await self.tell_external(to, message, sender=reply_to)
            await arrived.wait()
        finally:
            self.unregister_sink(reply_to)
            actor.pending_asks.pop(reply_to, None)
        if not replies:
            raise ActorStopped(f"actor {to!r} stopped before replying to {type(message).__name__}")
        return replies[0]

    def _live(self, address: Address) -> _Actor:
        actor = self._actors.get(address)
        if actor is None or actor.stopped:
            raise ActorStopped(f"no running actor at {address!r}")
        return actor

    # ------------------------------------------------------------------ effects

    def start_timer(self, delay_s: float, address: Address, message: Message) -> None:
        async def fire() -> None:
            with anyio.CancelScope() as scope:
                self._timers.add(scope)
                try:
                    await anyio.sleep(delay_s)
                    self.tell(address, message, sender=address)
                finally:
                    self._timers.discard(scope)

        self._tg.start_soon(fire, name=f"timer for {address}")

    def cancel_timers(self) -> None:
        """Drop every pending timer (at shutdown nothing waits for a far deadline)."""
        for scope in list(self._timers):
            scope.cancel()

    def run_compute(self, actor: _Actor, job: Callable[[], None], done: Message) -> None:
        if actor.executor is None:
            raise RuntimeError(f"actor {actor.address!r} was not spawned with a compute executor")
        generation = actor.executor_generation

        def run() -> None:
            try:
                job()
            finally:
                if generation != actor.executor_generation:
                    release_thread_resources()  # abandoned: its thread exits after this job

        future = actor.executor.submit(run)

        def finished(fut: Future[None]) -> None:
            if generation != actor.executor_generation or fut.cancelled():
                # Abandoned: nobody waits for it any more, and the loop may be gone by now.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._count_abandoned, done)
                return
            # A job must hand errors back itself; one escaping it is a bug: crash the actor.
            error = fut.exception()
            message: Message | _Crash = done if error is None else _Crash(error)
            self._loop.call_soon_threadsafe(self._deliver_compute, actor, message)

        future.add_done_callback(finished)

    def run_background(self, actor: _Actor, job: Callable[[], None], done: Message) -> None:
        """``Context.background``: ``job`` on the actor's I/O thread, then ``done`` to it."""
        if actor.io is None:
            actor.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{actor.address}/io")

        def finished(fut: Future[None]) -> None:
            if fut.cancelled():
                return
            error = fut.exception()
            message: Message | _Crash = done if error is None else _Crash(error)
            with contextlib.suppress(RuntimeError):  # the loop may be gone at shutdown
                self._loop.call_soon_threadsafe(self._deliver_compute, actor, message)

        actor.io.submit(job).add_done_callback(finished)

    def abandon_compute(self, actor: _Actor) -> None:
        """Give up ``actor``'s running and queued jobs (``Context.abandon_compute``). A thread
        stuck in a job cannot be killed: it is left behind; the actor computes on a fresh one."""
        old = actor.executor
        if old is None:
            return
        actor.executor_generation += 1
        actor.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=actor.address)
        old.shutdown(wait=False, cancel_futures=True)
        log.warning("actor %s: abandoned its compute thread (a job may still run there)",
                    actor.address)  # fmt: skip

    def _count_abandoned(self, done: Message) -> None:
        self.dead_letters[f"abandoned_compute:{type(done).__name__}"] += 1

    def _deliver_compute(self, actor: _Actor, message: Message | _Crash) -> None:
        if isinstance(message, _Crash):
            self._tg.start_soon(_reraise, message.error)
            return
        try:
            actor.send.send_nowait(Envelope(message, actor.address))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            # The actor stopped while its last job ran (shutdown waits for it): nothing to do.
            self.dead_letters[f"no_actor:{type(message).__name__}"] += 1

    # ------------------------------------------------------------------ the mailbox loop

    async def _run(self, actor: _Actor) -> None:
        ctx = _ActorContext(self, actor)
        tracker = RestartTracker(actor.policy)
        actor.core.on_start(ctx)
        try:
            async with actor.receive:
                async for item in actor.receive:
                    if actor.space is not None and self._below_capacity(actor):
                        actor.space.set()
                        actor.space = None
                    if isinstance(item, _Stop):
                        break
                    try:
                        actor.core.handle(item.message, item.sender, ctx)
                    except Exception as exc:
                        self._supervise(actor, ctx, tracker, exc)
                    self._progressed()
        finally:
            with anyio.CancelScope(shield=True):
                await self._shut_down(actor, ctx)

    def _below_capacity(self, actor: _Actor) -> bool:
        return actor.send.statistics().current_buffer_used < actor.capacity

    def _supervise(
        self, actor: _Actor, ctx: _ActorContext, tracker: RestartTracker, error: Exception
    ) -> None:
        log.error("actor %s crashed handling a message", actor.address, exc_info=error)
        recover = getattr(actor.core, "crashed", None)
        if recover is None or not tracker.may_restart(time.monotonic()):
            raise SupervisionEscalated(
                f"actor {actor.address!r} crashed beyond its restart intensity: {error!r}"
            ) from error
        recover(error, ctx)

    async def _shut_down(self, actor: _Actor, ctx: _ActorContext) -> None:
        actor.stopped = True
        actor.core.on_stop(ctx)
        if actor.executor is not None:
            # Wait for the running job: memory is freed only once compute has stopped.
            actor.executor.submit(release_thread_resources)
            await anyio.to_thread.run_sync(actor.executor.shutdown)
        if actor.io is not None:  # a write under way finishes: a file is whole or not there
            await anyio.to_thread.run_sync(actor.io.shutdown)
        if self._actors.get(actor.address) is actor:
            del self._actors[actor.address]
        for waiting in actor.pending_asks.values():
            waiting.set()  # wakes the asker with no reply: it raises ActorStopped
        actor.send.close()
        self._progressed()


def release_thread_resources() -> None:
    """Run last on a compute thread: MLX needs ``clear_streams`` before a thread that used it
    exits, or the process may abort at exit."""
    mlx_core = sys.modules.get("mlx.core")
    if mlx_core is not None:
        mlx_core.clear_streams()


@dataclass(frozen=True)
class _Crash:
    error: BaseException


async def _reraise(error: BaseException) -> None:
    raise SupervisionEscalated(f"a compute job raised past its own handler: {error!r}") from error
