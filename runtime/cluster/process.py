"""The engine's own process: one Ray actor hosting one engine core, fed in the wire form.

Ray runs this class as an async actor (``runtime.cluster.proxy`` makes it remote with the
resources the engine needs). Inside, a small transport drives the engine core exactly as the
production one does (runtime/kernel/actor.py): one mailbox loop on the actor's event loop,
compute jobs on one thread, timers on the loop. Mail in comes as numbered batches of wire bytes
(``deliver``; Ray does not promise an async actor runs calls in the order they were made, so the
numbers put them back in order); mail out waits in an ``Outbox`` until the host collects it
(``take``, a long poll), coalesced. A compute job that raises past its own handler, or a crash
with no recovery, ends the process: the host sees it lost and restarts the engine elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from actors.standing import BuildOnNode
from runtime.cluster.outbox import Outbox, Wired
from runtime.kernel.actor import release_thread_resources
from runtime.kernel.core import ActorCore, Address
from runtime.messages import Message, Stats, decode, encode

log = logging.getLogger("mlx_actor_runtime.cluster")

EXIT_ON_BUG = 70  # a job or handler raised past its own handling: the process ends (EX_SOFTWARE)


class EngineProcess:
    """One engine in its own process (see module docstring)."""

    def __init__(self, address: Address, build: BuildOnNode) -> None:
        self._address = address
        self._build = build
        self._core: ActorCore | None = None
        self._outbox = Outbox()
        self._next_batch = 1
        self._early: dict[int, list[Wired]] = {}  # batches that came before their turn
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=address)
        self._io: ThreadPoolExecutor | None = None  # the I/O thread, made at the first job
        self._generation = 0  # grows when compute is abandoned: older jobs' ends are dropped
        self.dead_letters: Counter[str] = Counter()
        # Made here, not in start(): Ray may run a deliver() before start() (no order promised).
        self._mail: asyncio.Queue[tuple[Message, Address]] = asyncio.Queue()
        self._mail_out = asyncio.Event()

    async def start(self) -> tuple[int, str, str, int]:
        """Build the core and start its mailbox loop; returns this process's id, its Ray node's
        id, that node's IP address and the niceness its threads (the compute thread's too) run
        at."""
        import ray

        self._loop = asyncio.get_running_loop()
        node = ray.get_runtime_context().get_node_id()
        node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self._core = self._build(node, node_ip)
        self._task = self._loop.create_task(self._run(self._core))
        return os.getpid(), node, node_ip, os.nice(0)

    async def deliver(self, number: int, items: list[Wired]) -> None:
        """Batch ``number`` of mail from the host: (sender, wire bytes) pairs, in order."""
        self._early[number] = items
        while self._next_batch in self._early:
            for sender, data in self._early.pop(self._next_batch):
                self._mail.put_nowait((decode(data), sender))
            self._next_batch += 1

    async def take(self, wait_s: float) -> tuple[list[Wired], bytes | None]:
        """What the engine sent since the last take (waiting up to ``wait_s`` for something),
        and its statistics now, both in the wire form."""
        if not len(self._outbox):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._mail_out.wait(), wait_s)
        self._mail_out.clear()
        statistics = getattr(self._core, "statistics", None)
        stats: Stats | None = statistics() if statistics is not None else None
        if stats is not None and self._outbox.merged:
            counters = {**stats.counters, "transport_tokens_merged": self._outbox.merged}
            stats = Stats(actor=stats.actor, counters=counters, gauges=stats.gauges,
                          limits=stats.limits)  # fmt: skip
        return self._outbox.take(), None if stats is None else encode(stats)

    # ------------------------------------------------------------------ the transport

    async def _run(self, core: ActorCore) -> None:
        ctx = _ProcessContext(self)
        core.on_start(ctx)
        while True:
            message, sender = await self._mail.get()
            try:
                core.handle(message, sender, ctx)
            except Exception as error:
                recover = getattr(core, "crashed", None)
                log.error("engine %s crashed handling a message", self._address, exc_info=error)
                if recover is None:
                    os._exit(EXIT_ON_BUG)
                recover(error, ctx)

    def send(self, to: Address, message: Message) -> None:
        if to == self._address:
            self._mail.put_nowait((message, to))
            return
        self._outbox.put(to, message)
        self._mail_out.set()

    def send_later(self, delay_s: float, message: Message) -> None:
        self._loop.call_later(delay_s, self._mail.put_nowait, (message, self._address))

    def compute(self, job: Callable[[], None], done: Message) -> None:
        generation = self._generation

        def finished(future: Future[None]) -> None:
            if generation != self._generation or future.cancelled():
                return  # abandoned: nobody waits for it
            if future.exception() is not None:
                log.error("engine %s: a compute job raised past its handler", self._address,
                          exc_info=future.exception())  # fmt: skip
                os._exit(EXIT_ON_BUG)
            self._loop.call_soon_threadsafe(self._mail.put_nowait, (done, self._address))

        self._executor.submit(job).add_done_callback(finished)

    def background(self, job: Callable[[], None], done: Message) -> None:
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="io")

        def finished(future: Future[None]) -> None:
            if future.exception() is not None:
                log.error("engine %s: an I/O job raised past its handler", self._address,
                          exc_info=future.exception())  # fmt: skip
                os._exit(EXIT_ON_BUG)
            self._loop.call_soon_threadsafe(self._mail.put_nowait, (done, self._address))

        self._io.submit(job).add_done_callback(finished)

    def abandon_compute(self) -> None:
        """Leave a stuck job behind (its thread dies with the process, which the host kills)."""
        self._generation += 1
        old, self._executor = self._executor, ThreadPoolExecutor(max_workers=1)
        old.submit(release_thread_resources)
        old.shutdown(wait=False, cancel_futures=True)

    @property
    def address(self) -> Address:
        return self._address


class _ProcessContext:
    """``runtime.kernel.core.Context`` for the engine inside its process."""

    def __init__(self, process: EngineProcess) -> None:
        self._process = process

    @property
    def self_address(self) -> Address:
        return self._process.address

    def now(self) -> float:
        return time.monotonic()

    def send(self, to: Address, message: Message) -> None:
        self._process.send(to, message)

    def send_later(self, delay_s: float, message: Message) -> None:
        self._process.send_later(delay_s, message)

    def spawn(self, address: Address, core: ActorCore) -> None:
        raise RuntimeError("an engine process hosts one engine; it spawns no actors")

    def stop(self, address: Address) -> None:
        raise RuntimeError("an engine process stops no actors; the host stops it")

    def compute(self, job: Callable[[], None], done: Message) -> None:
        self._process.compute(job, done)

    def background(self, job: Callable[[], None], done: Message) -> None:
        self._process.background(job, done)

    def abandon_compute(self) -> None:
        self._process.abandon_compute()

    def count_dead_letter(self, reason: str) -> None:
        self._process.dead_letters[reason] += 1
