"""An engine that gave up: what it still answers until the router stops it.

An engine gives up after a crash of its handler or a compute step that overran
``step_timeout_s`` (core.py ``_give_up``): its sequences have ended and it has asked the keeper to
release its epoch. From then on it answers only that: on ``EpochReleased`` it tells the router
``EngineFailed`` (the router reloads the model, or fails it), or ``Drained`` if an unload asked
for a drain first; a ``Drain`` after the release is answered at once. Anything else is stale (an
``Admit`` sent before the router heard ends with the router's ``EngineFailed`` handling).
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.errors import MlxRuntimeError
from runtime.kernel.core import ROUTER, Address, Context
from runtime.kernel.stats import Counters
from runtime.messages import Drain, Drained, EngineFailed, EpochReleased, GetStats, Message, Stats


class Retirement:
    """A given-up engine's last words (see module docstring)."""

    def __init__(self, epoch: int, error: MlxRuntimeError, drain_requester: Address | None) -> None:
        self.error = error  # what its sequences failed with
        self._epoch = epoch
        self._drain_requester = drain_requester  # set: an unload asked for a drain first
        self._released = False

    def handle(
        self,
        message: Message,
        sender: Address,
        ctx: Context,
        stats: Callable[[], Stats],
        counters: Counters,
    ) -> None:
        match message:
            case EpochReleased(epoch=epoch) if epoch == self._epoch:
                self._released = True
                if self._drain_requester is not None:
                    ctx.send(self._drain_requester, Drained(epoch=epoch))
                    return
                error = self.error
                ctx.send(ROUTER, EngineFailed(epoch=epoch, code=error.code, message=error.message))
            case Drain(epoch=epoch) if epoch == self._epoch and self._drain_requester is None:
                self._drain_requester = sender
                if self._released:
                    ctx.send(sender, Drained(epoch=epoch))
            case GetStats():
                ctx.send(sender, stats())
            case _:
                ctx.count_dead_letter("engine_gave_up")
                counters.inc("stale_messages")
