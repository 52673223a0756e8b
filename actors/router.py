"""The router actor: the single entry point that owns request identities and model lifecycles.

It validates routing (model loaded, request id not live), maps each request ``(id, incarnation)``
to ``(engine, sequence id, epoch)``, forwards engine events to the host that sent the request (each
is the host event it means; the router adds the request's identity), and fences teardown: an
unloading model admits nothing, and anything from an epoch other than the model's current one is
dropped and counted. The model table itself (loads, unloads, shutdown) is ``ModelLifecycle``;
deadlines and the stall guard, which end a request without waiting for its engine, are
``RequestGuards`` (deadlines.py).

Keep-alive and auto-load (docs/protocols.md): the router's own ``IdleCheck`` timer unloads a model
idle for its keep-alive; a request for a model the keep-alive is unloading is *parked* until the
drain ends, then sent on to the model loaded again. So a request that meets the keep-alive is
either admitted to the old epoch (it came first: the timer is then stale) or to the new one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import assert_never

import msgspec

from actors.deadlines import Expiry, RequestGuards
from actors.live_requests import Live, LiveRequests, cancelled_by_unload, failed_with
from actors.model_lifecycle import EngineFactory, ModelLifecycle, ModelState, not_loaded
from actors.replicas import ModelTable, Replicas, ResetWait
from runtime.errors import DuplicateRequestId
from runtime.kernel.core import PREFIX_CACHE, Address, Context, engine_address, engine_model
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
    for_request,
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
    ) -> None:
        """``stall_timeout_s``: the stall guard of a generate that sets none (None: off).
        ``auto_load``: a request for a loading or idle model waits for it (else: refused)."""
        self._models = models = ModelLifecycle(
            engine_factory, engine_restart or RestartPolicy(), auto_load=auto_load
        )
        self._replicas = Replicas(
            ModelTable(
                models.load, models.unload, models.knows, models.serving, models.live, models.loaded
            )
        )
        self._live = LiveRequests()
        # Requests for a model its keep-alive is unloading: sent on once it is loaded again.
        self._parked: dict[str, tuple[Generate | Prewarm, Address]] = {}
        self._next_sequence_id = 1
        self._reset_waiters: deque[ResetWait] = deque()  # one prefix manager answers in order
        # Engines answer independently of each other; one engine answers its own asks in order.
        self._session_waiters: dict[tuple[Address, str], deque[Address]] = {}
        self.counters = Counters()
        self._guards = RequestGuards(stall_timeout_s, self.counters)

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
                self._guards.shown(message, ctx)
                ctx.send(live.host, for_request(message, live.request_id, live.incarnation))
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
                self._move_unstarted(epoch, ctx)  # to another replica, if the model has one
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
            case ResetPrefixes(model=model):
                # A model with replicas resets each serving one (a restarting one holds nothing).
                loads = [
                    n for n in self._replicas.names(model) or (model,) if self._models.ready(n)
                ]
                if not loads:
                    ctx.send(sender, not_loaded(model))
                    return
                wait = ResetWait(sender, model, len(loads))
                for name in loads:
                    self._reset_waiters.append(wait)
                    one = msgspec.structs.replace(message, model=name)
                    ctx.send(PREFIX_CACHE, one)
                    serving = self._models.ready(name)
                    if serving is not None:  # its disk tier forgets the scope too, before new work
                        ctx.send(serving.address, one)
            case PrefixesReset() if sender != PREFIX_CACHE or not self._reset_waiters:
                self._unmatched_reply(message, ctx)
            case PrefixesReset():
                wait = self._reset_waiters.popleft()
                if (done := wait.answered(message)) is not None:
                    ctx.send(wait.asker, done)
            case EndSession(model=model, session=session):
                ready = self._models.ready(self._replicas.holder(model, session))
                if ready is None:
                    ctx.send(sender, not_loaded(model))
                    return
                self._session_waiters.setdefault((ready.address, session), deque()).append(sender)
                ctx.send(ready.address, message)
            case SessionEnded() if not self._session_waiters.get((sender, message.session)):
                self._unmatched_reply(message, ctx)
            case SessionEnded():
                self._session_ended(message, sender, ctx)
            case GetStats():
                ctx.send(sender, self.statistics())
            case Shutdown():
                self._replicas.clear()
                self._models.shutdown(sender, ctx)
            case CachedElsewhere():
                self._cached_elsewhere(message, ctx)
            case _:
                assert_never(message)

    # ------------------------------------------------------------------ command replies

    def _session_ended(self, reply: SessionEnded, engine: Address, ctx: Context) -> None:
        key = (engine, reply.session)
        waiters = self._session_waiters[key]
        asker = waiters.popleft()
        if not waiters:
            del self._session_waiters[key]
        ctx.send(asker, reply)

    def _unmatched_reply(self, reply: Message, ctx: Context) -> None:
        """A reply nobody is waiting for (a bug elsewhere, or a stray sender): drop and count it."""
        self.counters.inc("unmatched_replies")
        ctx.count_dead_letter(f"unmatched_reply:{type(reply).__name__}")

    # ------------------------------------------------------------------ requests

    def _accept(
        self,
        request: Generate | Prewarm,
        host: Address,
        ctx: Context,
        *,
        replica: str | None = None,
        avoid: str | None = None,
    ) -> None:
        """Admit ``request``; for a model with replicas, to ``replica`` or the one routing picks
        (never ``avoid``, a replica it is being moved off)."""
        if self._live.has_request(request.request_id) or request.request_id in self._parked:
            text = (
                f"request id {request.request_id!r} is still running; wait for its end, "
                "cancel it, or use a new id"
            )
            self._reject(request, host, ctx, DuplicateRequestId.code, text)
            return
        sent = request
        if request.model in self._replicas:
            chosen = replica or self._replicas.route(request.model, request.session, avoid)
            request = msgspec.structs.replace(request, model=chosen)
        model = self._models.admitting(request.model, ctx)
        if model is None and self._models.reloads_after_drain(request.model):
            self.counters.inc("requests_parked")
            self._parked[request.request_id] = (request, host)
            return
        if model is None:
            code, text = self._models.unavailable(request.model)
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
            moved=avoid is not None,
        )
        self._live.add(live)
        self._models.request_started(model)
        if isinstance(request, Generate) and request.keep_alive_s is not None:
            self._models.keep_alive_from_now(model, request.keep_alive_s)
        is_generate = isinstance(request, Generate)
        self.counters.inc("accepted_generate" if is_generate else "accepted_prewarm")
        self._guards.accepted(request, sequence_id, model.epoch, ctx)
        ctx.send(
            model.address,
            Admit(
                sequence_id=sequence_id,
                epoch=model.epoch,
                session=request.session or f"{request.model}/{request.namespace}",
                request=request,
            ),
        )

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
            if request.model == name:
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
        terminal = for_request(event, live.request_id, live.incarnation)
        self.counters.inc(f"terminal_{type(terminal).__name__.lower()}")
        ctx.send(live.host, terminal)

    # ------------------------------------------------------------------ replicas

    def _cached_elsewhere(self, hint: CachedElsewhere, ctx: Context) -> None:
        """Move a request that has not started to the replica holding more of its prompt."""
        live = self._live.of_sequence(hint.sequence_id)
        gain = hint.matched_there - hint.matched_here
        if (
            live is None
            or live.request.model not in self._replicas
            or live.epoch != hint.epoch
            or live.moved
            or self._live.has_started(hint.sequence_id)
            or not self._replicas.worth_moving(live.request.model, live.model, hint.elsewhere, gain)
        ):
            self.counters.inc("moves_declined")
            return
        self._move(live, hint.elsewhere, ctx)
        self._replicas.stick(live.request.model, live.request.session, hint.elsewhere)

    def _move_unstarted(self, epoch: int, ctx: Context) -> None:
        """A replica's engine failed: what it had not started goes to another replica."""
        for live in self._live.of_epoch(epoch):
            name = live.request.model
            if not self._live.has_started(live.sequence_id) and len(self._replicas.names(name)) > 1:
                self._move(live, None, ctx)

    def _move(self, live: Live, to: str | None, ctx: Context) -> None:
        """Send ``live``'s request to replica ``to`` (None: the one routing picks, never its
        own) as if it came now; its first sequence is aborted (quietly dropped if it answers)."""
        sequence_id = live.sequence_id
        self._live.pop(sequence_id)
        self._guards.ended(sequence_id)
        self._models.request_ended(live.model, live.epoch, ctx)
        abort = Abort(sequence_id=sequence_id, epoch=live.epoch, reason="moved")
        ctx.send(engine_address(live.model, live.epoch), abort)
        self.counters.inc("requests_moved")
        self._accept(live.request, live.host, ctx, replica=to, avoid=live.model)

    def _end_orphans(
        self, epoch: int, ctx: Context, terminal: Callable[[Live], EngineTerminal]
    ) -> None:
        """End what an engine that drained or gave up left live: after ``Drained``, nothing
        (counted, defensively); after ``EngineFailed``, the requests admitted after it gave up."""
        for live in self._live.of_epoch(epoch):
            self.counters.inc("orphaned_requests")
            self._end_request(terminal(live), ctx)
