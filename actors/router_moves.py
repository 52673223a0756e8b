"""Requests the router moves from one replica of a model to another before they start.

Two things move a request (docs/cluster.md, "Routing across replicas"): the prefix manager saying
what each replica holds of its prompt (``CachedElsewhere``, after every lookup: moved once to the
replica with the lowest estimated time to first token, actors/replica_costs.py), and its
replica's engine failing (``EngineFailed``: what it had not started goes to another replica). A
move aborts the first sequence quietly and sends the request again through the router's
acceptance, keeping its deadline and, when the hint carries them, its prompt's tokens, so the
replica it moves to does not tokenize it again.
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
        """Note the request's uncached tokens (its replica's queue) and move it, if it has not
        started, to the replica its first token would come soonest from."""
        live = self._live.of_sequence(hint.sequence_id)
        held_elsewhere = hint.matched_there > hint.matched_here
        if live is None or live.epoch != hint.epoch:
            self._counters.inc("moves_declined", int(held_elsewhere))
            return
        self._live.looked_up(hint.sequence_id, len(hint.tokens) - hint.matched_here)
        asked = live.request.request
        if (
            asked.model not in self._replicas
            or live.moved
            or self._live.has_started(hint.sequence_id)
        ):
            self._counters.inc("moves_declined", int(held_elsewhere))
            return
        matches = {**hint.matches, live.model: hint.matched_here}
        to = self._replicas.destination(
            asked.model,
            asked.session,
            live.model,
            hint.sequence_id,
            len(hint.tokens),
            matches,
            hint.resident,
        )
        if to == live.model:  # held elsewhere maybe, but its queue costs more than it saves
            self._counters.inc("moves_declined", int(held_elsewhere))
            return
        if matches.get(to, 0) <= hint.matched_here:
            self._counters.inc("moves_for_queue")  # away from a queue costlier than its cache
        self._move(live, to, ctx, hint)
        self._replicas.stick(asked.model, asked.session, to)

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
