"""The router actor: the single entry point that owns request identities and model lifecycles.

One owner for "which request is which sequence on which engine epoch" makes teardown and restarts
safe: it maps each request ``(id, incarnation)`` to ``(engine, sequence id, epoch)``, forwards
engine events to the host and fences teardown: an unloading model admits nothing, and mail from any
other epoch is dropped and counted. Its parts live beside it: the model table (``ModelLifecycle``),
deadlines (deadlines.py), commands passed on (router_commands.py), moves between replicas
(router_moves.py). A request meeting a keep-alive unload waits for the drain.

The protocols it speaks, with their invariants: docs/protocols.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import assert_never

import msgspec

from actors.deadlines import Expiry, RequestGuards
from actors.live_requests import Live, LiveRequests, cancelled_by_unload, failed_with
from actors.model_lifecycle import EngineFactory, ModelLifecycle
from actors.model_record import ModelState
from actors.replica_costs import RoutingCosts
from actors.replicas import ModelTable, Replicas
from actors.router_commands import CommandReplies
from actors.router_moves import Moves
from runtime.errors import DuplicateRequestId
from runtime.kernel.core import Address, Context, engine_address, engine_model
from runtime.kernel.stats import Counters
from runtime.kernel.supervision import RestartPolicy
from runtime.messages import (
    Abort,
    Admit,
    CachedElsewhere,
    Cancel,
    Cancelled,
    CommandFailed,
    Drained,
    EndSession,
    EngineEvent,
    EngineFailed,
    EngineLoadFailed,
    EngineProbed,
    EngineReady,
    EngineTerminal,
    Failed,
    Generate,
    GetStats,
    IdleCheck,
    ListModels,
    LoadModel,
    Message,
    ModelsListed,
    PrefixesReset,
    Prewarm,
    Rejected,
    RequestDeadline,
    ResetPrefixes,
    RouterInbox,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    SessionEnded,
    Shutdown,
    StallCheck,
    Stats,
    TokensProduced,
    UnloadModel,
    Usage,
)

# Per-model engine failures are counted under this prefix plus the model (beside the total).
ENGINES_FAILED_OF = "engines_failed:"


class RouterCore:
    """State and decisions of the router (see module docstring)."""

    def __init__(
        self,
        engine_factory: EngineFactory,
        engine_restart: RestartPolicy | None = None,
        *,
        stall_timeout_s: float | None = None,
        auto_load: bool = True,
        routing_costs: RoutingCosts | None = None,
    ) -> None:
        """``stall_timeout_s``: the stall guard of a generate that sets none (None: off).
        ``auto_load``: a request for a loading or idle model waits for it (else: refused).
        ``routing_costs``: the weights of the replica choice (None: the defaults)."""
        self._models = models = ModelLifecycle(
            engine_factory, engine_restart or RestartPolicy(), auto_load=auto_load
        )
        self._live = live = LiveRequests()
        self._replicas = Replicas(
            ModelTable(
                models.load,
                models.unload,
                models.knows,
                models.serving,
                models.live,
                models.loaded,
                live.queued_on,
            ),
            routing_costs,
        )
        # Requests for a model its keep-alive is unloading: sent on once it is loaded again.
        self._parked: dict[str, tuple[Generate | Prewarm, Address]] = {}
        self._next_sequence_id = 1
        self.counters = Counters()
        self._commands = CommandReplies(models, self._replicas, self.counters)
        self._guards = RequestGuards(stall_timeout_s, self.counters)
        self._moves = Moves(
            self._live, self._guards, models, self._replicas, self.counters, self._resend
        )

    def on_start(self, ctx: Context) -> None:
        pass

    def on_stop(self, ctx: Context) -> None:
        pass

    def statistics(self) -> Stats:
        gauges = {
            "live_requests": len(self._live),
            "models": len(self._models),
            "models_restarting": self._models.count(ModelState.RESTARTING),
            "models_failed": self._models.count(ModelState.FAILED),
            "models_loading": self._models.count(ModelState.LOADING),
            "models_idle": self._models.idle_count,
            "parked_requests": len(self._parked),
            "expired_awaiting_engine": self._guards.expired_awaiting_engine,
        }
        return Stats(actor="router", counters=self.counters.snapshot(), gauges=gauges)

    def expired_awaiting_engine(self) -> frozenset[int]:
        """Sequences of requests ended on a deadline or stall whose engine has not let go yet
        (for tests: those may outlive their request's terminal, until the engine's)."""
        return self._guards.awaiting_engine

    def live_sequences(self) -> dict[int, tuple[str, int]]:
        """Sequence id → (request id, incarnation) of every request still running (for tests)."""
        return self._live.sequences()

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        """Apply one message; one outside ``RouterInbox`` is dropped and counted."""
        if isinstance(message, RouterInbox):
            self._receive(message, sender, ctx)
        else:
            ctx.count_dead_letter("router_unexpected")

    def _receive(self, message: RouterInbox, sender: Address, ctx: Context) -> None:
        match message:
            case Generate() | Prewarm():
                self._accept(message, sender, ctx)
            case Cancel(request_id=request_id, incarnation=incarnation):
                self._cancel(request_id, incarnation, ctx)
            case (
                SequenceStarted()
                | TokensProduced()
                | SequenceFinished()
                | SequenceCancelled()
                | SequenceFailed()
            ) if not self._live.is_live(message.sequence_id, message.epoch):
                self._not_live(message, ctx)
            case SequenceStarted() | TokensProduced():
                live = self._live.of_sequence(message.sequence_id)
                assert live is not None  # the arm above sends the not-live ones elsewhere
                self._live.started(message.sequence_id)
                if isinstance(message, TokensProduced):
                    self._live.decoding(message.sequence_id)
                self._guards.shown(message, ctx)
                ctx.send(live.host, message.for_request(live.request_id, live.incarnation))
            case SequenceFinished() | SequenceCancelled() | SequenceFailed():
                self._end_request(message, ctx)
            case RequestDeadline() | StallCheck() if sender != ctx.self_address:
                ctx.count_dead_letter("router_unexpected")  # only the router's own timers count
            case RequestDeadline() | StallCheck():
                for sequence_id, expiry in self._guards.fired(ctx):
                    self._expire(sequence_id, expiry, ctx)
            case IdleCheck() if sender != ctx.self_address:
                ctx.count_dead_letter("router_unexpected")
            case IdleCheck():
                if self._models.idle_check(message, ctx):
                    self.counters.inc("models_idle_unloaded")
                else:  # a request came, or the model went, since the timer was armed
                    self.counters.inc("idle_checks_stale")
                    ctx.count_dead_letter("stale_idle_check")
            case ListModels():
                ctx.send(sender, ModelsListed(models=self._models.statuses(ctx.now())))
            case LoadModel(spec=spec) if spec.replicas > 1:
                self._replicas.load(spec, sender, ctx)
            case LoadModel(spec=spec):
                self._models.load(spec, sender, ctx)
            case EngineReady() | EngineProbed() | EngineLoadFailed() | EngineFailed() if (
                not self._models.is_current(sender, message.epoch)
            ):
                ctx.count_dead_letter("stale_engine_event")
            case EngineFailed(epoch=epoch, code=code, message=text):
                self.counters.inc("engines_failed")
                self.counters.inc(f"{ENGINES_FAILED_OF}{engine_model(sender)}")
                self._moves.unstarted_of(epoch, ctx)  # to another replica, if the model has one
                self._end_orphans(epoch, ctx, lambda live: failed_with(live, code, text))
                self._guards.epoch_drained(epoch)  # a given-up engine answers nothing more
                self._models.engine_failed(message, sender, ctx)
            case EngineLoadFailed(epoch=epoch, code=code, message=text):
                # Requests an auto-load admitted to the loading engine end with the load.
                self._end_orphans(
                    epoch, ctx, lambda live: failed_with(live, code, text, retry=False)
                )
                self._models.engine_loaded(message, sender, ctx)
                replica = engine_model(sender) or ""
                self._replicas.engine_loaded(replica, CommandFailed(code=code, message=text), ctx)
                self._replicas.drained(replica, ctx)
            case EngineReady():
                self._models.engine_loaded(message, sender, ctx)
                self._replicas.engine_loaded(engine_model(sender) or "", None, ctx)
            case EngineProbed():
                self._models.engine_probed(message, sender)
            case UnloadModel(model=model):
                if not self._replicas.unload(model, sender, ctx):
                    self._models.unload(model, sender, ctx)
            case Drained(epoch=epoch) if not self._models.is_draining(sender, epoch):
                ctx.count_dead_letter("stale_engine_event")
            case Drained(epoch=epoch):
                unloaded = self._models.remove_drained(sender, epoch, ctx)
                self._end_orphans(epoch, ctx, cancelled_by_unload)
                self._guards.epoch_drained(epoch)
                self._models.announce_unloaded(unloaded, ctx)
                self._replicas.drained(unloaded.spec.name, ctx)
                self._send_on_parked(unloaded.spec.name, ctx)
            case ResetPrefixes():
                self._commands.reset_prefixes(message, sender, ctx)
            case PrefixesReset():
                self._commands.prefixes_reset(message, sender, ctx)
            case EndSession():
                self._commands.end_session(message, sender, ctx)
            case SessionEnded():
                self._commands.session_ended(message, sender, ctx)
            case GetStats():
                ctx.send(sender, self.statistics())
            case Shutdown():
                self._replicas.clear()
                self._models.shutdown(sender, ctx)
            case CachedElsewhere():
                self._moves.cached_elsewhere(message, ctx)
            case _:
                assert_never(message)

    # ------------------------------------------------------------------ requests

    def _accept(
        self,
        request: Generate | Prewarm,
        host: Address,
        ctx: Context,
        *,
        replica: str | None = None,
        moved: Live | None = None,
        carried: CachedElsewhere | None = None,
    ) -> None:
        """Admit ``request``; for a model with replicas, to ``replica`` or the one routing picks
        (never the one ``moved`` ran on: it is being moved off, keeping its deadline, with its
        prompt as its first replica tokenized it if ``carried`` says)."""
        if self._live.has_request(request.request_id) or request.request_id in self._parked:
            text = (
                f"request id {request.request_id!r} is still running; wait for its end, "
                "cancel it, or use a new id"
            )
            self._reject(request, host, ctx, DuplicateRequestId.code, text)
            return
        sent = request
        asked = request.request
        if asked.model in self._replicas:
            avoid = None if moved is None else moved.model
            chosen = replica or self._replicas.route(asked.model, asked.session, avoid)
            routed = msgspec.structs.replace(request.request, model=chosen)
            request = msgspec.structs.replace(request, request=routed)
        model = self._models.admitting(request.request.model, ctx)
        if model is None and self._models.reloads_after_drain(request.request.model):
            self.counters.inc("requests_parked")
            self._parked[request.request_id] = (request, host)
            return
        if model is None:
            code, text = self._models.unavailable(request.request.model)
            self._reject(request, host, ctx, code, text)
            return
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        live = Live(
            request.request_id,
            request.incarnation,
            host,
            model.spec.name,
            model.epoch,
            sequence_id,
            sent,
            accepted_at=ctx.now() if moved is None else moved.accepted_at,
            moved=moved is not None,
        )
        self._live.add(live)
        self._models.request_started(model)
        keep_alive_s = request.request.keep_alive_s  # None on a prewarm (validation.py)
        if keep_alive_s is not None:
            self._models.keep_alive_from_now(model, keep_alive_s)
        is_generate = isinstance(request, Generate)
        self.counters.inc("accepted_generate" if is_generate else "accepted_prewarm")
        self._guards.accepted(request, sequence_id, model.epoch, ctx, since=live.accepted_at)
        ctx.send(
            model.address,
            Admit(
                sequence_id=sequence_id,
                epoch=model.epoch,
                session=asked.session or f"{request.request.model}/{asked.namespace}",
                request=request,
                tokens=carried.tokens if carried and carried.tokens else None,
                facts=None if carried is None else carried.facts,
            ),
        )

    def _resend(
        self, live: Live, replica: str | None, hint: CachedElsewhere | None, ctx: Context
    ) -> None:
        """``live``'s request moved off its replica: accepted again, on ``replica``."""
        self._accept(live.request, live.host, ctx, replica=replica, moved=live, carried=hint)

    def _reject(
        self, request: Generate | Prewarm, host: Address, ctx: Context, code: str, text: str
    ) -> None:
        self.counters.inc(f"rejected_{code}")
        ctx.send(
            host,
            Rejected(
                request_id=request.request_id,
                incarnation=request.incarnation,
                code=code,
                message=text,
            ),
        )

    def _send_on_parked(self, name: str, ctx: Context) -> None:
        """``name`` drained: its parked requests go to the model loaded again (or are refused,
        if it was unloaded on purpose meanwhile), in the order they came."""
        for request_id, (request, host) in list(self._parked.items()):
            if request.request.model == name:
                del self._parked[request_id]
                self._accept(request, host, ctx)

    def _cancel(self, request_id: str, incarnation: int, ctx: Context) -> None:
        parked = self._parked.get(request_id)
        if parked is not None and parked[0].incarnation == incarnation:
            del self._parked[request_id]
            self.counters.inc("terminal_cancelled")
            ctx.send(
                parked[1], Cancelled(request_id=request_id, incarnation=incarnation, usage=Usage())
            )
            return
        live = self._live.of_request(request_id)
        if live is None or live.incarnation != incarnation:
            self.counters.inc("cancels_noop")  # finished, unknown, or meant for another incarnation
            return
        self.counters.inc("cancels_routed")
        ctx.send(
            engine_address(live.model, live.epoch),
            Abort(sequence_id=live.sequence_id, epoch=live.epoch),
        )

    def _not_live(self, event: EngineEvent, ctx: Context) -> None:
        if self._guards.absorbs(event, ctx):  # its request already ended on a deadline or stall
            return
        self.counters.inc("stale_engine_events")
        ctx.count_dead_letter("stale_engine_event")

    def _expire(self, sequence_id: int, expiry: Expiry, ctx: Context) -> None:
        """End a live request now, on its deadline or a stall: the host hears ``Failed`` at once
        (its engine may be unable to answer); the engine is told to abort the sequence."""
        live = self._live.pop(sequence_id)
        self._models.request_ended(live.model, live.epoch, ctx)
        error = expiry.error
        ctx.send(
            engine_address(live.model, live.epoch),
            Abort(sequence_id=sequence_id, epoch=live.epoch, reason=error.code),
        )
        self.counters.inc("terminal_failed")
        failed = Failed(
            request_id=live.request_id,
            incarnation=live.incarnation,
            code=error.code,
            message=error.message,
            retryable=error.retryable,
            usage=expiry.usage,
        )
        ctx.send(live.host, failed)

    def _end_request(self, event: EngineTerminal, ctx: Context) -> None:
        live = self._live.pop(event.sequence_id)
        self._guards.ended(event.sequence_id)
        self._models.request_ended(live.model, live.epoch, ctx)
        terminal = event.for_request(live.request_id, live.incarnation)
        self.counters.inc(f"terminal_{type(terminal).__name__.lower()}")
        ctx.send(live.host, terminal)

    def _end_orphans(
        self, epoch: int, ctx: Context, terminal: Callable[[Live], EngineTerminal]
    ) -> None:
        """End what an engine that drained or gave up left live: after ``Drained``, nothing
        (counted, defensively); after ``EngineFailed``, the requests admitted after it gave up."""
        for live in self._live.of_epoch(epoch):
            self.counters.inc("orphaned_requests")
            self._end_request(terminal(live), ctx)
