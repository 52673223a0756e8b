"""What stands in for an engine whose process was lost (killed, out of memory, a native crash).

An engine in a process of its own (runtime/cluster/) can vanish with everything it held: its
sequences, its prefix entries' states, its reservations. Nothing of it can answer, so the host-side
stand-in answers for it, as an engine that gave up would (retirement.py): it asks the prefix
manager to forget the epoch's entries and the keeper to release the epoch's bytes, and once the
keeper confirms, tells the router ``EngineFailed`` (``engine_process_lost``, retryable): the router
ends the epoch's live requests with that error and restarts the model at a new epoch. The Ray
proxy uses it when its process dies; the simulator's "engine process lost" fault swaps it in for
an engine core, so the fuzzer explores the same protocol.
"""

from __future__ import annotations

from actors.engine.retirement import Retirement
from runtime.errors import EngineProcessLost
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, Address, Context
from runtime.kernel.stats import Counters
from runtime.messages import InvalidateEpoch, Message, ReleaseEpoch, Stats


def process_lost_error(model: str, why: str) -> EngineProcessLost:
    """The error the lost engine's requests fail with (retryable: a new process is starting)."""
    return EngineProcessLost(
        f"the engine process of model {model!r} was lost ({why}); it is restarted in a new "
        "process with its model reloaded: retry the request"
    )


class LostEngine:
    """An engine core's stand-in once its process is gone (see module docstring)."""

    def __init__(
        self,
        model: str,
        epoch: int,
        why: str,
        drain_requester: Address | None = None,
        counters: Counters | None = None,
    ) -> None:
        self.model = model
        self.epoch = epoch
        self.counters = counters or Counters()
        self._address = ""
        self._retired = Retirement(epoch, process_lost_error(model, why), drain_requester)

    def on_start(self, ctx: Context) -> None:
        """The loss is known: forget the epoch's entries and release its memory, now."""
        self._address = ctx.self_address
        self.counters.inc("engine_process_lost")
        ctx.send(PREFIX_CACHE, InvalidateEpoch(model=self.model, epoch=self.epoch))
        ctx.send(KV_KEEPER, ReleaseEpoch(model=self.model, epoch=self.epoch))

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        self._retired.handle(message, sender, ctx, self.statistics, self.counters)

    def on_stop(self, ctx: Context) -> None:
        pass

    def statistics(self) -> Stats:
        return Stats(actor=self._address, counters=self.counters.snapshot(), gauges={})
