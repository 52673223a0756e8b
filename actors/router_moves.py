"""Requests the router moves from one replica of a model to another before they start.

Two things move a request (docs/cluster.md, "Routing across replicas"): the prefix manager saying
another replica holds more of its prompt (``CachedElsewhere``: moved there once, if worth it and
that replica is not overloaded), and its replica's engine failing (``EngineFailed``: what it had
not started goes to another replica). A move lets the first sequence go (aborted quietly: what
its engine still says is stale) and sends the request again through the router's acceptance,
keeping its deadline (``timeout_s`` counts from its first acceptance) and, when the prefix
manager's hint carries them, its prompt's tokens, so the replica it moves to does not tokenize it
again.
"""

from __future__ import annotations

from collections.abc import Callable

from actors.deadlines import RequestGuards
from actors.live_requests import Live, LiveRequests
from actors.model_lifecycle import ModelLifecycle
from actors.replicas import Replicas
from runtime.kernel.core import Context, engine_address
from runtime.kernel.stats import Counters
from runtime.messages import Abort, CachedElsewhere

# Accept ``live``'s request again on replica ``to`` (None: the one routing picks, never its own),
# with the tokens a hint carried (None: none known).
Resend = Callable[[Live, str | None, CachedElsewhere | None, Context], None]


class Moves:
    """The router's moves between replicas (see module docstring)."""

    def __init__(
        self,
        live: LiveRequests,
        guards: RequestGuards,
        models: ModelLifecycle,
        replicas: Replicas,
        counters: Counters,
        resend: Resend,
    ) -> None:
        self._live = live
        self._guards = guards
        self._models = models
        self._replicas = replicas
        self._counters = counters
        self._resend = resend

    def cached_elsewhere(self, hint: CachedElsewhere, ctx: Context) -> None:
        """Move a request that has not started to the replica holding more of its prompt."""
        live = self._live.of_sequence(hint.sequence_id)
        gain = hint.matched_there - hint.matched_here
        if live is None:
            self._counters.inc("moves_declined")
            return
        asked = live.request.request
        if (
            asked.model not in self._replicas
            or live.epoch != hint.epoch
            or live.moved
            or self._live.has_started(hint.sequence_id)
            or not self._replicas.worth_moving(asked.model, live.model, hint.elsewhere, gain)
        ):
            self._counters.inc("moves_declined")
            return
        self._move(live, hint.elsewhere, ctx, hint)
        self._replicas.stick(asked.model, asked.session, hint.elsewhere)

    def unstarted_of(self, epoch: int, ctx: Context) -> None:
        """A replica's engine failed: what it had not started goes to another replica."""
        for live in self._live.of_epoch(epoch):
            name = live.request.request.model
            if not self._live.has_started(live.sequence_id) and len(self._replicas.names(name)) > 1:
                self._move(live, None, ctx)

    def _move(
        self, live: Live, to: str | None, ctx: Context, hint: CachedElsewhere | None = None
    ) -> None:
        """Send ``live``'s request to replica ``to`` (None: the one routing picks, never its
        own); its first sequence is aborted (quietly dropped if it answers)."""
        sequence_id = live.sequence_id
        self._live.pop(sequence_id)
        self._guards.ended(sequence_id)
        self._models.request_ended(live.model, live.epoch, ctx)
        abort = Abort(sequence_id=sequence_id, epoch=live.epoch, reason="moved")
        ctx.send(engine_address(live.model, live.epoch), abort)
        self._counters.inc("requests_moved")
        self._resend(live, to, hint, ctx)
