"""The router's model table: each model's load, its epoch and state, and who waits on it.

A model is ``LOADING``, ``READY``, ``UNLOADING``, ``RESTARTING`` (its engine gave up and a new one
reloads the model) or ``FAILED`` (past the restart intensity, or not reloadable). Every load and
restart gets a new epoch and so a new engine address, so mail for an old load never reaches a new
one. Load, unload and shutdown askers are answered here; the router keeps the requests. Keep-alive
unloads an idle model through the same fenced drain as any unload and keeps its spec as *idle*; with
auto-load a request for it loads it again.

See docs/protocols.md, "Teardown fencing (unload / drain)" and "Model keep-alive and auto-load".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import msgspec

from actors.keep_alive import KeepAlive
from actors.model_record import (
    Model,
    ModelState,
    log_loaded,
    not_loaded,
    refusal,
    status_of,
)
from runtime.errors import (
    ModelAlreadyLoaded,
    ModelLoading,
    ModelUnloading,
)
from runtime.kernel.core import ActorCore, Address, Context
from runtime.kernel.supervision import RestartPolicy, RestartTracker
from runtime.messages import (
    CommandFailed,
    Drain,
    EngineFailed,
    EngineLoadFailed,
    EngineProbed,
    EngineReady,
    IdleCheck,
    ModelLoaded,
    ModelSpec,
    ModelStatus,
    ModelUnloaded,
    ShutdownComplete,
)

EngineFactory = Callable[[ModelSpec, int], ActorCore]

log = logging.getLogger("mlx_actor_runtime.models")


class ModelLifecycle:
    """Loads, unloads and shutdown of the router's models (see module docstring)."""

    def __init__(
        self, engine_factory: EngineFactory, restart_policy: RestartPolicy, *, auto_load: bool
    ) -> None:
        self._engine_factory = engine_factory
        self._restart_policy = restart_policy
        self._auto_load = auto_load
        self._models: dict[str, Model] = {}
        self._idle: dict[str, tuple[ModelSpec, int]] = {}  # unloaded by keep-alive: spec, epoch
        self._next_epoch = 1
        self._shutdown_waiters: list[Address] = []
        self.keep_alive = KeepAlive()

    def __len__(self) -> int:
        return len(self._models)

    def ready(self, name: str) -> Model | None:
        """The model called ``name`` if it admits requests now."""
        model = self._models.get(name)
        return model if model is not None and model.state is ModelState.READY else None

    def count(self, state: ModelState) -> int:
        """How many models are in ``state``."""
        return sum(model.state is state for model in self._models.values())

    @property
    def idle_count(self) -> int:
        """How many models the keep-alive unloaded and a request may load again."""
        return len(self._idle)

    def admitting(self, name: str, ctx: Context) -> Model | None:
        """The model a request for ``name`` goes to now, or None if it is refused (or parked:
        ``reloads_after_drain``). Ready; or, with auto-load, loading (its engine holds the
        request until the model is in) or idle, which starts loading it again here."""
        model = self._models.get(name)
        if model is not None and model.state is ModelState.READY:
            return model
        if not self._auto_load or self._shutdown_waiters:
            return None
        if model is not None:
            return model if model.state is ModelState.LOADING else None
        if name not in self._idle:
            return None
        spec, _ = self._idle.pop(name)
        return self._start_load(spec, asker=None, ctx=ctx)

    def reloads_after_drain(self, name: str) -> bool:
        """Whether ``name`` is being unloaded by its keep-alive and comes back (auto-load) for a
        request that arrives meanwhile: such a request waits for the drain, then the reload."""
        model = self._models.get(name)
        if model is None or not self._auto_load or self._shutdown_waiters:
            return False
        return model.state is ModelState.UNLOADING and model.idle_unload

    def request_started(self, model: Model) -> None:
        """A request was admitted to ``model``'s current epoch: it is busy."""
        self.keep_alive.started(model.epoch)

    def keep_alive_from_now(self, model: Model, keep_alive_s: float) -> None:
        """A request set ``model``'s keep-alive (``math.inf``: forever): its next idle spell,
        and every one after, uses it (its reload after an idle unload too)."""
        kept = None if math.isinf(keep_alive_s) else keep_alive_s
        model.spec = msgspec.structs.replace(model.spec, keep_alive_s=kept)

    def request_ended(self, name: str, epoch: int, ctx: Context) -> None:
        """A request of ``name`` at ``epoch`` ended; the last one of a ready model makes it idle."""
        if not self.keep_alive.ended(epoch):
            return
        model = self._models.get(name)
        if model is not None and model.epoch == epoch and model.state is ModelState.READY:
            self.keep_alive.went_idle(name, epoch, model.spec.keep_alive_s, ctx)

    def idle_check(self, check: IdleCheck, ctx: Context) -> bool:
        """Unload the model ``check`` names if it is still in the idle spell the timer was armed
        for; False (stale: the caller counts it) otherwise."""
        model = self._models.get(check.model)
        if (
            model is None
            or model.epoch != check.epoch
            or model.state is not ModelState.READY
            or not self.keep_alive.is_due(check)
        ):
            return False
        model.idle_unload = True
        self.unload(check.model, asker=None, ctx=ctx, idle=True)
        return True

    def statuses(self, now: float) -> tuple[ModelStatus, ...]:
        """Every model in the table and every idle one, by name (``ListModels``)."""
        found = [status_of(model, self.keep_alive, now) for model in self._models.values()]
        found += [
            ModelStatus(name=spec.name, state="idle", epoch=epoch, path=spec.path,
                        live_requests=0, keep_alive_s=spec.keep_alive_s)
            for spec, epoch in self._idle.values()
        ]  # fmt: skip
        return tuple(sorted(found, key=lambda status: status.name))

    def unavailable(self, name: str) -> tuple[str, str]:
        """Why a request for ``name``, which is not ``ready``, is refused: a code and a sentence."""
        return refusal(name, self._models.get(name))

    def is_current(self, engine: Address, epoch: int) -> bool:
        """Whether ``engine`` at ``epoch`` is a load still in the table (not a stale one)."""
        return self._at(engine, epoch) is not None

    def is_draining(self, engine: Address, epoch: int) -> bool:
        """Whether ``engine`` at ``epoch`` was asked to drain and has not reported it yet."""
        model = self._at(engine, epoch)
        return model is not None and model.state is ModelState.UNLOADING

    def knows(self, name: str) -> bool:
        """Whether ``name`` is in the table (in any state but idle)."""
        return name in self._models

    def serving(self, name: str) -> bool:
        """Whether a request for ``name`` is admitted now (ready, or loading with auto-load)."""
        model = self._models.get(name)
        if model is None or self._shutdown_waiters:
            return False
        return model.state is ModelState.READY or (
            self._auto_load and model.state is ModelState.LOADING
        )

    def live(self, name: str) -> int:
        """Live requests of ``name``'s current epoch."""
        model = self._models.get(name)
        return 0 if model is None else self.keep_alive.live(model.epoch)

    def loaded(self, name: str) -> ModelLoaded | None:
        model = self._models.get(name)
        return None if model is None else model.loaded

    def load(self, spec: ModelSpec, asker: Address | None, ctx: Context) -> None:
        """Load ``spec``; ``asker`` (if any) hears ``ModelLoaded`` or ``CommandFailed``."""
        failed = self._models.get(spec.name)
        if failed is not None and failed.state is ModelState.FAILED:
            del self._models[spec.name]  # loading a failed model again puts it back in service
        present = self._models.get(spec.name)
        if present is not None and present.state is ModelState.LOADING:
            text = f"model {spec.name!r} is loading; wait for it (it is listed as loading)"
            if asker is not None:
                ctx.send(asker, CommandFailed(code=ModelLoading.code, message=text))
            return
        if present is not None or self._shutdown_waiters:
            text = f"model {spec.name!r} is already loaded; unload it first to load it anew"
            if asker is not None:
                ctx.send(asker, CommandFailed(code=ModelAlreadyLoaded.code, message=text))
            return
        self._idle.pop(spec.name, None)  # loaded on purpose: this spec replaces the idle one
        self._start_load(spec, asker, ctx)

    def _start_load(self, spec: ModelSpec, asker: Address | None, ctx: Context) -> Model:
        model = Model(
            spec=spec,
            epoch=self._next_epoch,
            state=ModelState.LOADING,
            restarts=RestartTracker(self._restart_policy),
        )
        self._next_epoch += 1
        model.load_waiter = asker
        model.since = ctx.now()
        self._models[spec.name] = model
        ctx.spawn(model.address, self._engine_factory(spec, model.epoch))
        return model

    def engine_loaded(
        self, event: EngineReady | EngineLoadFailed, engine: Address, ctx: Context
    ) -> None:
        """Answer the load's asker; ``engine`` at ``event.epoch`` must be current."""
        model = self._current(engine, event.epoch)
        waiter, model.load_waiter = model.load_waiter, None
        if isinstance(event, EngineLoadFailed) and model.state is ModelState.RESTARTING:
            ctx.stop(engine)
            model.state = ModelState.FAILED
            model.failure = (
                f"model {model.spec.name!r} could not be reloaded after its engine failed "
                f"({event.message}); load it again with load_model"
            )
            return
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
        model.placement = event.placement
        model.loaded = ModelLoaded(
            model=model.spec.name,
            epoch=model.epoch,
            reuse_path=event.reuse_path,
            bytes_per_token=event.bytes_per_token,
            context_length=event.context_length,
            chat_template=event.chat_template,
            limits=event.limits,
        )
        if model.state in (ModelState.LOADING, ModelState.RESTARTING):
            restarted = model.state is ModelState.RESTARTING
            log_loaded(
                model.spec,
                model.loaded,
                ctx.now() - model.since,
                restarted=restarted,
                pending=event.probe_pending,
            )
            model.state = ModelState.READY
            if not self.keep_alive.live(model.epoch):
                self.keep_alive.went_idle(
                    model.spec.name, model.epoch, model.spec.keep_alive_s, ctx
                )
        if waiter is not None:
            ctx.send(waiter, model.loaded)

    def engine_probed(self, event: EngineProbed, engine: Address) -> None:
        """``engine`` (current at ``event.epoch``) ran its deferred load probe: what the model's
        status and a later load's answer say changes to the verdict's (the engine logged it)."""
        model = self._current(engine, event.epoch)
        if model.loaded is not None:
            model.loaded = msgspec.structs.replace(
                model.loaded, reuse_path=event.reuse_path, limits=event.limits
            )

    def engine_failed(self, event: EngineFailed, engine: Address, ctx: Context) -> None:
        """``engine`` (current at ``event.epoch``) gave up; its requests have ended and its
        memory is back. Reload the model at a new epoch within its restart intensity, else take
        it out of service (``FAILED``). An unloading one just drains: its ``Drained`` follows."""
        model = self._current(engine, event.epoch)
        if model.state is ModelState.UNLOADING:
            return
        if model.state is ModelState.LOADING:  # it never became ready: the load failed
            failed = EngineLoadFailed(epoch=event.epoch, code=event.code, message=event.message)
            self.engine_loaded(failed, engine, ctx)
            return
        ctx.stop(engine)
        self.keep_alive.forget(model.epoch)
        if model.restarts.may_restart(ctx.now()):
            model.epoch = self._next_epoch
            self._next_epoch += 1
            model.state = ModelState.RESTARTING
            model.since = ctx.now()
            ctx.spawn(model.address, self._engine_factory(model.spec, model.epoch))
            return
        policy = self._restart_policy
        model.state = ModelState.FAILED
        model.failure = (
            f"model {model.spec.name!r} was taken out of service: its engine failed "
            f"{policy.max_restarts + 1} times within {policy.within_s:g} s, more than "
            f"RuntimeConfig.engine_restart allows (last: {event.message}); load it again with "
            "load_model once the cause is fixed"
        )

    def unload(self, name: str, asker: Address | None, ctx: Context, *, idle: bool = False) -> None:
        """Unload ``name`` (``idle``: its keep-alive ran out; otherwise the host or a shutdown
        asked, and the model is forgotten rather than kept idle)."""
        if not idle:
            self._idle.pop(name, None)
        model = self._models.get(name)
        if model is not None and not idle:
            model.idle_unload = False  # asked to: nothing reloads it
        if model is None:
            if asker is not None:
                ctx.send(asker, not_loaded(name))
            return
        if model.state is ModelState.FAILED:  # no engine runs: nothing to drain
            del self._models[name]
            if asker is not None:
                ctx.send(asker, ModelUnloaded(model=name, epoch=model.epoch))
            self._maybe_shutdown_complete(ctx)
            return
        if asker is not None:
            model.unload_waiters.append(asker)
        if model.state is not ModelState.UNLOADING:
            model.state = ModelState.UNLOADING  # admits nothing from now on
            model.since = ctx.now()
            self.keep_alive.forget(model.epoch)
            ctx.send(model.address, Drain(epoch=model.epoch))

    def remove_drained(self, engine: Address, epoch: int, ctx: Context) -> Model:
        """Forget a model whose engine drained and stop that engine; it must be draining."""
        model = self._current(engine, epoch)
        del self._models[model.spec.name]
        ctx.stop(engine)
        if model.idle_unload and not self._shutdown_waiters:
            self._idle[model.spec.name] = (model.spec, model.epoch)
        if model.idle_unload:
            keep = model.spec.keep_alive_s
            why = f"idle for its keep-alive of {keep:g} s; a request loads it again"
        else:
            why = "at shutdown" if self._shutdown_waiters else "as asked"
        level = logging.DEBUG if self._shutdown_waiters else logging.INFO
        log.log(level, "unloaded %s (%s; drained in %.1f s)", model.spec.name, why,
                ctx.now() - model.since)  # fmt: skip
        return model

    def announce_unloaded(self, model: Model, ctx: Context) -> None:
        """Answer whoever waited on a model that ``remove_drained`` took out of the table."""
        for asker in model.unload_waiters:
            ctx.send(asker, ModelUnloaded(model=model.spec.name, epoch=model.epoch))
        if model.load_waiter is not None:
            failure = CommandFailed(code=ModelUnloading.code, message="unloaded while loading")
            ctx.send(model.load_waiter, failure)
        self._maybe_shutdown_complete(ctx)

    def shutdown(self, asker: Address, ctx: Context) -> None:
        self._idle.clear()
        if not self._models:
            ctx.send(asker, ShutdownComplete())
            return
        self._shutdown_waiters.append(asker)
        for name in list(self._models):
            self.unload(name, asker=None, ctx=ctx)

    def _maybe_shutdown_complete(self, ctx: Context) -> None:
        if self._shutdown_waiters and not self._models:
            for asker in self._shutdown_waiters:
                ctx.send(asker, ShutdownComplete())
            self._shutdown_waiters.clear()

    def _at(self, engine: Address, epoch: int) -> Model | None:
        for model in self._models.values():
            if model.epoch == epoch and model.address == engine:
                return model
        return None

    def _current(self, engine: Address, epoch: int) -> Model:
        model = self._at(engine, epoch)
        if model is None:  # the router's stale-epoch arm filters these out first
            raise LookupError(f"no current model at {engine!r} epoch {epoch}")
        return model
