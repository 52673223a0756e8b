"""A ``Context`` that records what a core asked for, for testing one core without any transport."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from runtime.kernel.core import ActorCore, Address, Context
from runtime.messages import Message, ModelSpec


class RecordingContext:
    """Records sends, timers, spawns and compute jobs; time is what the test sets ``clock`` to."""

    def __init__(self, self_address: Address, clock: float = 0.0) -> None:
        self._self_address = self_address
        self.clock = clock
        self.sent: list[tuple[Address, Message]] = []
        self.timers: list[tuple[float, Message]] = []
        self.spawned: list[tuple[Address, ActorCore]] = []
        self.stopped: list[Address] = []
        self.jobs: list[tuple[Callable[[], None], Message]] = []
        self.abandoned_jobs = 0  # jobs given up by ``abandon_compute``
        self.dead_letters: Counter[str] = Counter()

    @property
    def self_address(self) -> Address:
        return self._self_address

    def now(self) -> float:
        return self.clock

    def send(self, to: Address, message: Message) -> None:
        self.sent.append((to, message))

    def send_later(self, delay_s: float, message: Message) -> None:
        self.timers.append((self.clock + delay_s, message))

    def spawn(self, address: Address, core: ActorCore) -> None:
        self.spawned.append((address, core))

    def stop(self, address: Address) -> None:
        self.stopped.append(address)

    def compute(self, job: Callable[[], None], done: Message) -> None:
        self.jobs.append((job, done))

    def background(self, job: Callable[[], None], done: Message) -> None:
        self.jobs.append((job, done))

    def abandon_compute(self) -> None:
        self.abandoned_jobs += len(self.jobs)
        self.jobs.clear()

    def count_dead_letter(self, reason: str) -> None:
        self.dead_letters[reason] += 1

    def take_sent(self) -> list[tuple[Address, Message]]:
        """Return and forget what was sent so far."""
        sent, self.sent = self.sent, []
        return sent

    def due_timers(self) -> list[Message]:
        """Pop the timers whose time has come (by ``clock``), earliest first."""
        due = sorted((t for t in self.timers if t[0] <= self.clock), key=lambda t: t[0])
        self.timers = [t for t in self.timers if t[0] > self.clock]
        return [message for _, message in due]


class IdleEngine:
    """Stands in for an engine when a test drives the router alone: it does nothing, ever."""

    def on_start(self, ctx: Context) -> None:
        pass

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        pass

    def on_stop(self, ctx: Context) -> None:
        pass


def idle_engine(spec: ModelSpec, epoch: int) -> ActorCore:
    """An engine factory for ``RouterCore`` whose engines are ``IdleEngine``s."""
    return IdleEngine()
