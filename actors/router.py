"""The router actor: the single entry point that owns request identities and model lifecycles.

It validates routing (model loaded, request id not live), maps each request ``(id, incarnation)``
to ``(engine, sequence id, epoch)``, forwards engine events to the host that sent the request, and
fences teardown: an unloading model admits nothing, and anything from an epoch other than the
model's current one is dropped and counted.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from runtime.errors import DuplicateRequestId, ModelAlreadyLoaded, ModelNotLoaded, ModelUnloading
from runtime.kernel.core import PREFIX_CACHE, ActorCore, Address, Context, engine_address
from runtime.kernel.stats import Counters
from runtime.messages import (
    Abort,
    Admit,
    Cancel,
    Cancelled,
    CommandFailed,
    Drain,
    Drained,
    EndSession,
    EngineLoadFailed,
    EngineReady,
    Failed,
    Finished,
    Generate,
    GetStats,
    LoadModel,
    Message,
    ModelLoaded,
    ModelSpec,
    ModelUnloaded,
    PrefixesReset,
    Prewarm,
    Rejected,
    RequestKind,
    ResetPrefixes,
    Sampling,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    SessionEnded,
    Shutdown,
    ShutdownComplete,
    Started,
    Stats,
    TokensEmitted,
    TokensProduced,
    UnloadModel,
    Usage,
)

EngineFactory = Callable[[ModelSpec, int], ActorCore]


class ModelState(enum.Enum):
    LOADING = enum.auto()
    READY = enum.auto()
    UNLOADING = enum.auto()


@dataclass
class _Model:
    spec: ModelSpec
    epoch: int
    state: ModelState
    loaded: ModelLoaded | None = None
    load_waiter: Address | None = None
    unload_waiters: list[Address] = field(default_factory=list)

    @property
    def address(self) -> Address:
        return engine_address(self.spec.name, self.epoch)


@dataclass(frozen=True)
class _Live:
    request_id: str
    incarnation: int
    host: Address
    model: str
    epoch: int
    sequence_id: int


class RouterCore:
    """State and decisions of the router (see module docstring)."""

    def __init__(self, engine_factory: EngineFactory) -> None:
        self._engine_factory = engine_factory
        self._models: dict[str, _Model] = {}
        self._live_by_request: dict[str, _Live] = {}
        self._live_by_sequence: dict[int, _Live] = {}
        self._next_sequence_id = 1
        self._next_epoch = 1
        self._reset_waiters: deque[Address] = deque()  # one prefix manager answers in order
        # Engines answer independently of each other; one engine answers its own asks in order.
        self._session_waiters: dict[tuple[Address, str], deque[Address]] = {}
        self._shutdown_waiters: list[Address] = []
        self.counters = Counters()

    def on_start(self, ctx: Context) -> None:
        pass

    def on_stop(self, ctx: Context) -> None:
        pass

    def statistics(self) -> Stats:
        gauges = {"live_requests": len(self._live_by_request), "models": len(self._models)}
        return Stats(actor="router", counters=self.counters.snapshot(), gauges=gauges)

    def live_sequences(self) -> dict[int, tuple[str, int]]:
        """Sequence id → (request id, incarnation) of every request still running (for tests)."""
        return {s: (v.request_id, v.incarnation) for s, v in self._live_by_sequence.items()}

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        match message:
            case Generate() | Prewarm():
                self._accept(message, sender, ctx)
            case Cancel(request_id=request_id, incarnation=incarnation):
                self._cancel(request_id, incarnation, ctx)
            case SequenceStarted() | TokensProduced():
                self._forward_progress(message, ctx)
            case SequenceFinished() | SequenceCancelled() | SequenceFailed():
                self._forward_terminal(message, ctx)
            case LoadModel(spec=spec):
                self._load(spec, sender, ctx)
            case EngineReady() | EngineLoadFailed():
                self._engine_loaded(message, sender, ctx)
            case UnloadModel(model=model):
                self._unload(model, sender, ctx)
            case Drained(epoch=epoch):
                self._drained(epoch, sender, ctx)
            case ResetPrefixes(model=model):
                if self._ready(model) is None:
                    ctx.send(sender, _not_loaded(model))
                    return
                self._reset_waiters.append(sender)
                ctx.send(PREFIX_CACHE, message)
            case PrefixesReset():
                if sender != PREFIX_CACHE or not self._reset_waiters:
                    self._unmatched_reply(message, ctx)
                    return
                ctx.send(self._reset_waiters.popleft(), message)
            case EndSession(model=model, session=session):
                ready = self._ready(model)
                if ready is None:
                    ctx.send(sender, _not_loaded(model))
                    return
                self._session_waiters.setdefault((ready.address, session), deque()).append(sender)
                ctx.send(ready.address, message)
            case SessionEnded():
                self._session_ended(message, sender, ctx)
            case GetStats():
                ctx.send(sender, self.statistics())
            case Shutdown():
                self._shutdown(sender, ctx)
            case _:
                ctx.count_dead_letter("router_unexpected")

    # ------------------------------------------------------------------ command replies

    def _session_ended(self, reply: SessionEnded, engine: Address, ctx: Context) -> None:
        key = (engine, reply.session)
        waiters = self._session_waiters.get(key)
        if not waiters:
            self._unmatched_reply(reply, ctx)
            return
        asker = waiters.popleft()
        if not waiters:
            del self._session_waiters[key]
        ctx.send(asker, reply)

    def _unmatched_reply(self, reply: Message, ctx: Context) -> None:
        """A reply nobody is waiting for (a bug elsewhere, or a stray sender): drop and count it."""
        self.counters.inc("unmatched_replies")
        ctx.count_dead_letter(f"unmatched_reply:{type(reply).__name__}")

    # ------------------------------------------------------------------ requests

    def _accept(self, request: Generate | Prewarm, host: Address, ctx: Context) -> None:
        model = self._ready(request.model)
        if model is None:
            self._reject(request, host, ctx, ModelNotLoaded.code, _not_loaded_text(request.model))
            return
        if request.request_id in self._live_by_request:
            text = (
                f"request id {request.request_id!r} is still running; wait for its end, "
                "cancel it, or use a new id"
            )
            self._reject(request, host, ctx, DuplicateRequestId.code, text)
            return
        sequence_id = self._next_sequence_id
        self._next_sequence_id += 1
        live = _Live(
            request.request_id, request.incarnation, host, model.spec.name, model.epoch, sequence_id
        )
        self._live_by_request[request.request_id] = live
        self._live_by_sequence[sequence_id] = live
        is_generate = isinstance(request, Generate)
        self.counters.inc("accepted_generate" if is_generate else "accepted_prewarm")
        ctx.send(
            model.address,
            Admit(
                sequence_id=sequence_id,
                epoch=model.epoch,
                kind=RequestKind.GENERATE if is_generate else RequestKind.PREWARM,
                prompt=request.prompt,
                prompt_tokens=request.prompt_tokens,
                messages=request.messages,
                chat=request.chat,
                sampling=request.sampling if isinstance(request, Generate) else Sampling(),
                max_tokens=request.max_tokens,
                stop=request.stop if isinstance(request, Generate) else (),
                stop_token_ids=request.stop_token_ids if isinstance(request, Generate) else (),
                namespace=request.namespace,
                session=request.session or f"{request.model}/{request.namespace}",
                supersede=isinstance(request, Generate) and request.supersede,
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

    def _cancel(self, request_id: str, incarnation: int, ctx: Context) -> None:
        live = self._live_by_request.get(request_id)
        if live is None or live.incarnation != incarnation:
            self.counters.inc("cancels_noop")  # finished, unknown, or meant for another incarnation
            return
        self.counters.inc("cancels_routed")
        ctx.send(
            engine_address(live.model, live.epoch),
            Abort(sequence_id=live.sequence_id, epoch=live.epoch),
        )

    def _live_for(self, sequence_id: int, epoch: int) -> _Live | None:
        live = self._live_by_sequence.get(sequence_id)
        if live is None or live.epoch != epoch:
            self.counters.inc("stale_engine_events")
            return None
        return live

    def _forward_progress(self, event: SequenceStarted | TokensProduced, ctx: Context) -> None:
        live = self._live_for(event.sequence_id, event.epoch)
        if live is None:
            ctx.count_dead_letter("stale_engine_event")
            return
        request_id, incarnation = live.request_id, live.incarnation
        if isinstance(event, SequenceStarted):
            out: Message = Started(
                request_id=request_id,
                incarnation=incarnation,
                sequence_id=event.sequence_id,
                epoch=event.epoch,
                prompt_tokens=event.prompt_tokens,
                cached_tokens=event.cached_tokens,
                path=event.path,
                dropped_turns=event.dropped_turns,
            )
        else:
            out = TokensEmitted(
                request_id=request_id,
                incarnation=incarnation,
                token_ids=event.token_ids,
                text=event.text,
                logprobs=event.logprobs,
            )
        ctx.send(live.host, out)

    def _forward_terminal(
        self, event: SequenceFinished | SequenceCancelled | SequenceFailed, ctx: Context
    ) -> None:
        live = self._live_for(event.sequence_id, event.epoch)
        if live is None:
            ctx.count_dead_letter("stale_engine_event")
            return
        del self._live_by_sequence[live.sequence_id]
        del self._live_by_request[live.request_id]
        request_id, incarnation = live.request_id, live.incarnation
        out: Message
        match event:
            case SequenceFinished(reason=reason, usage=usage, stop=stop):
                out = Finished(
                    request_id=request_id,
                    incarnation=incarnation,
                    reason=reason,
                    usage=usage,
                    stop=stop,
                )
            case SequenceCancelled(reason=cancel_reason, usage=usage):
                out = Cancelled(
                    request_id=request_id,
                    incarnation=incarnation,
                    reason=cancel_reason,
                    usage=usage,
                )
            case SequenceFailed(code=code, message=text, retryable=retryable, usage=usage):
                out = Failed(
                    request_id=request_id,
                    incarnation=incarnation,
                    code=code,
                    message=text,
                    retryable=retryable,
                    usage=usage,
                )
        self.counters.inc(f"terminal_{type(out).__name__.lower()}")
        ctx.send(live.host, out)

    # ------------------------------------------------------------------ model lifecycle

    def _ready(self, name: str) -> _Model | None:
        model = self._models.get(name)
        return model if model is not None and model.state is ModelState.READY else None

    def _load(self, spec: ModelSpec, asker: Address, ctx: Context) -> None:
        if spec.name in self._models or self._shutdown_waiters:
            text = f"model {spec.name!r} is already loaded or loading; unload it first"
            ctx.send(asker, CommandFailed(code=ModelAlreadyLoaded.code, message=text))
            return
        model = _Model(spec=spec, epoch=self._next_epoch, state=ModelState.LOADING)
        self._next_epoch += 1
        model.load_waiter = asker
        self._models[spec.name] = model
        ctx.spawn(model.address, self._engine_factory(spec, model.epoch))

    def _engine_loaded(
        self, event: EngineReady | EngineLoadFailed, engine: Address, ctx: Context
    ) -> None:
        model = self._model_at(engine, event.epoch)
        if model is None:
            ctx.count_dead_letter("stale_engine_event")
            return
        waiter, model.load_waiter = model.load_waiter, None
        if isinstance(event, EngineLoadFailed):
            del self._models[model.spec.name]
            ctx.stop(engine)
            failure = CommandFailed(code=event.code, message=event.message)
            if waiter is not None:
                ctx.send(waiter, failure)
            for asker in model.unload_waiters:  # nothing was loaded: the unload is done
                ctx.send(asker, ModelUnloaded(model=model.spec.name, epoch=model.epoch))
            self._maybe_shutdown_complete(ctx)
            return
        model.loaded = ModelLoaded(
            model=model.spec.name,
            epoch=model.epoch,
            reuse_path=event.reuse_path,
            bytes_per_token=event.bytes_per_token,
            context_length=event.context_length,
        )
        if model.state is ModelState.LOADING:
            model.state = ModelState.READY
        if waiter is not None:
            ctx.send(waiter, model.loaded)

    def _model_at(self, engine: Address, epoch: int) -> _Model | None:
        for model in self._models.values():
            if model.epoch == epoch and model.address == engine:
                return model
        return None

    def _unload(self, name: str, asker: Address | None, ctx: Context) -> None:
        model = self._models.get(name)
        if model is None:
            if asker is not None:
                ctx.send(asker, _not_loaded(name))
            return
        if asker is not None:
            model.unload_waiters.append(asker)
        if model.state is not ModelState.UNLOADING:
            model.state = ModelState.UNLOADING  # admits nothing from now on
            ctx.send(model.address, Drain(epoch=model.epoch))

    def _drained(self, epoch: int, engine: Address, ctx: Context) -> None:
        model = self._model_at(engine, epoch)
        if model is None or model.state is not ModelState.UNLOADING:
            ctx.count_dead_letter("stale_engine_event")
            return
        del self._models[model.spec.name]
        ctx.stop(engine)
        self._fail_orphans(model, ctx)
        for asker in model.unload_waiters:
            ctx.send(asker, ModelUnloaded(model=model.spec.name, epoch=epoch))
        if model.load_waiter is not None:
            failure = CommandFailed(code=ModelUnloading.code, message="unloaded while loading")
            ctx.send(model.load_waiter, failure)
        self._maybe_shutdown_complete(ctx)

    def _maybe_shutdown_complete(self, ctx: Context) -> None:
        if self._shutdown_waiters and not self._models:
            for asker in self._shutdown_waiters:
                ctx.send(asker, ShutdownComplete())
            self._shutdown_waiters.clear()

    def _fail_orphans(self, model: _Model, ctx: Context) -> None:
        """Defensive: an engine reports every terminal before ``Drained``; count any it did not."""
        for live in [v for v in self._live_by_sequence.values() if v.epoch == model.epoch]:
            self.counters.inc("orphaned_requests")
            self._forward_terminal(
                SequenceCancelled(
                    sequence_id=live.sequence_id,
                    epoch=live.epoch,
                    usage=Usage(),
                    reason="model_unloaded",
                ),
                ctx,
            )

    def _shutdown(self, asker: Address, ctx: Context) -> None:
        if not self._models:
            ctx.send(asker, ShutdownComplete())
            return
        self._shutdown_waiters.append(asker)
        for name in list(self._models):
            self._unload(name, asker=None, ctx=ctx)


def _not_loaded_text(name: str) -> str:
    return f"model {name!r} is not loaded; call load_model first (or check the name)"


def _not_loaded(name: str) -> CommandFailed:
    return CommandFailed(code=ModelNotLoaded.code, message=_not_loaded_text(name))
