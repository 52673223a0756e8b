"""The contract between an actor's synchronous core and whatever delivers its messages.

A core is a plain object with state and a ``handle`` method; it never awaits and never touches a
mailbox. Everything it wants done (send a message, wake up later, start an actor) goes through the
``Context`` it is handed. Two transports implement ``Context``: the production actor system
(anyio mailboxes, real clock, compute threads) and the deterministic simulator (virtual clock,
seeded choice of which actor runs next). The same core code runs on both, which is what lets
Hypothesis drive the real protocol logic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from runtime.messages import Message

Address = str

ROUTER: Address = "router"
KV_KEEPER: Address = "kv"
PREFIX_CACHE: Address = "prefix"
ENGINE_PREFIX = "engine:"


def engine_address(model: str, epoch: int) -> Address:
    """Each load of a model gets its own address: mail for an old load never reaches a new one."""
    return f"{ENGINE_PREFIX}{model}#{epoch}"


def engine_model(address: Address) -> str | None:
    """The model of an ``engine_address``; None for other actors' addresses."""
    if not address.startswith(ENGINE_PREFIX) or "#" not in address:
        return None
    return address.removeprefix(ENGINE_PREFIX).rpartition("#")[0]


class Context(Protocol):
    """What a core may ask of its transport while handling one message."""

    @property
    def self_address(self) -> Address: ...

    def now(self) -> float:
        """Monotonic seconds (virtual in the simulator)."""
        ...

    def send(self, to: Address, message: Message) -> None:
        """Queue ``message`` for ``to`` (delivered after ``handle`` returns, in send order)."""
        ...

    def send_later(self, delay_s: float, message: Message) -> None:
        """Deliver ``message`` to this actor itself after ``delay_s`` seconds."""
        ...

    def spawn(self, address: Address, core: ActorCore) -> None:
        """Start a new actor at ``address`` (used by the router to start engines)."""
        ...

    def stop(self, address: Address) -> None:
        """Stop the actor at ``address`` after it has handled what is already in its mailbox."""
        ...

    def compute(self, job: Callable[[], None], done: Message) -> None:
        """Run blocking ``job`` on this actor's compute executor, then deliver ``done`` to itself.

        Only engines compute. One job runs at a time per actor, in submission order.
        """
        ...

    def background(self, job: Callable[[], None], done: Message) -> None:
        """Run blocking I/O ``job`` on this actor's I/O thread, then deliver ``done`` to itself.

        Beside compute, never behind it (the disk tier's reads and writes: a decode step does not
        wait for them). One job at a time per actor, in submission order; a job hands its own
        errors back in its record, like a compute job.
        """
        ...

    def abandon_compute(self) -> None:
        """Stop waiting for this actor's compute: its running and queued jobs are given up (a
        thread stuck in one cannot be killed, only left behind), their ``done`` never arrives
        (counted ``abandoned_compute``), and any later job runs on a fresh executor."""
        ...

    def count_dead_letter(self, reason: str) -> None:
        """Record a message that was dropped on purpose (stale epoch, finished sequence...)."""
        ...


class ActorCore(Protocol):
    """An actor's state and decisions. ``handle`` must not block and must not raise on bad input."""

    def on_start(self, ctx: Context) -> None:
        """Called once before the first message (engines start loading their model here)."""
        ...

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        """Apply one message. Transports deliver any ``Message``: a core narrows it once to its
        inbox union (``RouterInbox``...), matches that to ``assert_never``, and counts the rest
        as dead letters."""
        ...

    def on_stop(self, ctx: Context) -> None:
        """Called once when the actor stops (after its last message), to release what it holds."""
        ...
