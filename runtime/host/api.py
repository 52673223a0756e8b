"""The host API: ``Runtime``, an async context manager that runs the actors on the host's loop.

Everything a host does is a message to the router; this module only turns those messages into
awaitables and per-request event streams. See docs/api.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import uuid
from collections import Counter
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar, Unpack

import anyio
import msgspec

from actors.replicas import ROUTING_POLICIES
from runtime.backends.choice import resolve_backend
from runtime.backends.contract import BackendLoader
from runtime.backends.loader import make_backend_loader
from runtime.backends.options import decode_options
from runtime.errors import (
    InvalidModelSpec,
    InvalidRequest,
    MlxRuntimeError,
    RuntimeClosed,
    error_for_code,
)
from runtime.host.config import RuntimeConfig
from runtime.host.options import GenerateOptions, PrewarmOptions, request_of
from runtime.host.standing import configured_actors
from runtime.host.streams import HOST, TERMINALS, Completion, GenerationStream, HostStreams
from runtime.host.validation import validate_request
from runtime.kernel.actor import ActorSystem
from runtime.kernel.core import ROUTER
from runtime.messages import (
    Cancelled,
    CommandFailed,
    EndSession,
    Failed,
    Finished,
    Generate,
    ListModels,
    LoadModel,
    Message,
    ModelLoaded,
    ModelsListed,
    ModelSpec,
    ModelStatus,
    ModelUnloaded,
    PrefixesReset,
    Prewarm,
    Request,
    ResetPrefixes,
    SessionEnded,
    Shutdown,
    Started,
    Stats,
    TokensEmitted,
    UnloadModel,
)
from runtime.text.coalesce import CoalescePolicy
from runtime.text.constraints import import_grammar_engine

if TYPE_CHECKING:
    from runtime.cluster.connect import ClusterLink  # imports Ray: only when a cluster is set

_T = TypeVar("_T")
SHUTDOWN_WAIT_S = 30.0  # leaving the Runtime waits this long for models to unload, then stops all

log = logging.getLogger("mlx_actor_runtime.api")


class RuntimeStats(msgspec.Struct, frozen=True, kw_only=True):
    """An immutable snapshot of every actor's counters, plus messages dropped on purpose."""

    actors: dict[str, Stats]
    dead_letters: dict[str, int]


class Runtime:
    """An embedded inference runtime. ``async with Runtime(config) as rt: ...``."""

    def __init__(
        self, config: RuntimeConfig | None = None, *, load_backend: BackendLoader | None = None
    ) -> None:
        """``load_backend`` replaces the loader of every backend kind (a test wraps it to inject
        faults: ``runtime.testing.faults``)."""
        self.config = config or RuntimeConfig()
        self._load_backend = load_backend
        self._system: ActorSystem | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._cluster: ClusterLink | None = None  # set while engines run on Ray
        self._incarnations = itertools.count(1)
        self._streams = HostStreams(self._require_system)

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Runtime:
        cluster = self.config.cluster
        if cluster is not None:  # Ray's start is blocking I/O: off the loop, with its own deadline
            from runtime.cluster.connect import connect

            self._cluster = await anyio.to_thread.run_sync(connect, cluster)
        # Validation compiles constraints on the loop; the grammar engine's first import reads
        # from disk, so it happens here, in a thread (a no-op once imported).
        await anyio.to_thread.run_sync(import_grammar_engine)
        stack = contextlib.AsyncExitStack()
        task_group = await stack.enter_async_context(anyio.create_task_group())
        system = ActorSystem(task_group, child_policy=self.config.engine_restart)
        system.register_sink(HOST, self._streams.deliver)
        for address, core in configured_actors(
            self.config,
            self._load_backend or make_backend_loader(),
            engine_host=None if self._cluster is None else self._cluster.wrap,
        ):
            capacity = self.config.router_mailbox_capacity if address == ROUTER else math.inf
            system.spawn(address, core, capacity=capacity)
        self._system, self._stack = system, stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        system, stack = self._system, self._stack
        assert system is not None
        assert stack is not None
        try:
            with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_WAIT_S) as waited:
                await system.ask(ROUTER, Shutdown())
            if waited.cancelled_caught:
                log.warning(
                    "leaving the Runtime: the shutdown did not finish within %s s; "
                    "stopping every actor without waiting for its models to unload",
                    SHUTDOWN_WAIT_S,
                )
        except MlxRuntimeError as error:
            # The host's own exception (if any) matters more: report this one, do not raise it.
            log.warning(
                "leaving the Runtime: the shutdown failed (%s: %s); stopping every actor anyway",
                error.code,
                error.message,
            )
        finally:
            for address in system.addresses():
                system.stop(address)
            system.cancel_timers()
            self._system = None
        try:
            return await stack.__aexit__(exc_type, exc, tb)
        except BaseExceptionGroup as group:
            # The host's own exception comes back wrapped by the task group: give it back as is.
            if exc is not None and len(group.exceptions) == 1 and group.exceptions[0] is exc:
                raise exc from None
            raise
        finally:
            cluster, self._cluster = self._cluster, None
            if cluster is not None:
                await anyio.to_thread.run_sync(cluster.close)

    # ------------------------------------------------------------------ models

    async def load_model(self, spec: ModelSpec) -> ModelLoaded:
        """Load a model; raises ``ModelAlreadyLoaded``, ``ModelLoadFailed`` or ``InvalidModelSpec``.

        The reply says which prefix-reuse path the model uses and its KV bytes per token. A spec
        whose options do not decode (an unknown name, a wrong type) raises before anything loads.
        """
        spec = resolve_backend(spec)  # "auto": a concrete kind from here on
        decode_options(spec)
        keep_alive_s = spec.keep_alive_s
        if keep_alive_s is not None and not keep_alive_s >= 0:  # NaN fails the test too
            raise InvalidModelSpec(
                f"keep_alive_s of model {spec.name!r} is {keep_alive_s}; give the seconds an idle "
                "model stays loaded (0 or more), or None to keep it loaded"
            )
        if spec.routing not in ROUTING_POLICIES:
            raise InvalidModelSpec(
                f"routing of model {spec.name!r} is {spec.routing!r}; choose one of "
                f"{', '.join(ROUTING_POLICIES)}"
            )
        if spec.replicas < 1:
            raise InvalidModelSpec(
                f"replicas of model {spec.name!r} is {spec.replicas}; give how many engines "
                "serve it (1 or more)"
            )
        reply = await self._ask(LoadModel(spec=spec))
        return _expect(reply, ModelLoaded)

    async def list_models(self) -> tuple[ModelStatus, ...]:
        """Every model the runtime knows, by name: loaded, loading, unloading, restarting,
        failed, or idle (unloaded by its keep-alive; a request loads it again with auto-load)."""
        return _expect(await self._ask(ListModels()), ModelsListed).models

    async def unload_model(self, model: str) -> ModelUnloaded:
        """Drain the model's requests, wait for its compute to stop, free its memory."""
        return _expect(await self._ask(UnloadModel(model=model)), ModelUnloaded)

    async def reset(self, model: str, namespace: str | None = None) -> PrefixesReset:
        """Drop cached prefixes of ``model`` (one namespace, or all); later requests observe it."""
        return _expect(
            await self._ask(ResetPrefixes(model=model, namespace=namespace)), PrefixesReset
        )

    async def end_session(
        self, model: str, session: str, namespace: str = "default"
    ) -> SessionEnded:
        """The session is over: its pinned instructions prefix becomes evictable again."""
        reply = await self._ask(EndSession(model=model, session=session, namespace=namespace))
        return _expect(reply, SessionEnded)

    # ------------------------------------------------------------------ requests

    def generate(
        self, model: str, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> GenerationStream:
        """A stream of this request's events; raises ``InvalidRequest`` on malformed input.

        The keywords are ``Request``'s fields (runtime/messages/request.py), built into one
        ``Request`` here; ``submit`` takes that value as it is (the HTTP server sends it so).
        ``timeout_s``: the request ends ``Failed(request_timeout)`` that long after it was
        accepted, whatever it is doing. ``stall_timeout_s``: it ends ``Failed(stream_stalled)``
        when no token came for that long after the first (None: ``config.stall_timeout_s``).
        ``reuse_prefix=False``: prefill the whole prompt, restoring nothing cached (``Started``
        then says 0 cached tokens); what it computes is still cached for later requests.
        ``keep_alive_s``: from this request on, the model's keep-alive (``math.inf``: never
        unloaded; 0: unloaded once idle); None leaves it as it is.
        """
        return self.submit(
            request_of(model, prompt, options),
            request_id=options.get("request_id"),
            coalesce=options.get("coalesce"),
        )

    def submit(
        self,
        request: Request,
        *,
        request_id: str | None = None,
        coalesce: CoalescePolicy | None = None,
    ) -> GenerationStream:
        """``generate`` for a ``Request`` built elsewhere, carried to the engine as it is."""
        message = Generate(
            request_id=request_id or uuid.uuid4().hex,
            incarnation=next(self._incarnations),
            request=request,
        )
        validate_request(message)
        policy = coalesce or self.config.coalesce
        if request.sampling.logprobs:  # one event per token, so each carries its logprobs
            policy = CoalescePolicy(enabled=False)
        return GenerationStream(self._streams, message, policy)

    async def complete(
        self, model: str, prompt: str | None = None, **options: Unpack[GenerateOptions]
    ) -> Completion:
        """Run ``generate`` to its end and collect the output."""
        texts: list[str] = []
        tokens: list[int] = []
        started: Started | None = None
        async with self.generate(model, prompt, **options) as stream:
            async for event in stream:
                match event:
                    case Started():
                        started = event
                    case TokensEmitted(text=text, token_ids=ids):
                        texts.append(text)
                        tokens.extend(ids)
                    case Finished() | Cancelled() | Failed():
                        return Completion(
                            text="".join(texts),
                            token_ids=tuple(tokens),
                            started=started,
                            terminal=event,
                        )
        raise RuntimeClosed("the runtime closed before the request ended")

    async def prewarm(
        self, model: str, prompt: str | None = None, **options: Unpack[PrewarmOptions]
    ) -> Finished | Cancelled | Failed:
        """Prefill and cache a prompt without sampling; returns how the warmup ended.
        ``keep_on_disk``: write the cached state to the disk tier at once (``Request``).

        ``Finished(reason="prewarmed")`` when cached (by it, or by an identical prewarm it
        followed), ``"adopted"`` when a request that extends it took it over,
        ``Cancelled(reason="superseded")`` when a diverging request of its session replaced it,
        ``Failed(request_timeout)`` when ``timeout_s`` passed first (what it had prefilled is kept).
        """
        request = request_of(model, prompt, options)
        return await self.submit_prewarm(request, request_id=options.get("request_id"))

    async def submit_prewarm(
        self, request: Request, *, request_id: str | None = None
    ) -> Finished | Cancelled | Failed:
        """``prewarm`` for a ``Request`` built elsewhere (its generate-only fields left out)."""
        message = Prewarm(
            request_id=request_id or uuid.uuid4().hex,
            incarnation=next(self._incarnations),
            request=request,
        )
        validate_request(message)
        async with GenerationStream(
            self._streams, message, CoalescePolicy(enabled=False)
        ) as stream:
            async for event in stream:
                if isinstance(event, TERMINALS):
                    return event
        raise RuntimeClosed("the runtime closed before the prewarm ended")

    async def cancel(self, request_id: str) -> bool:
        """Cancel the live request with this id; False (a no-op) if none is live."""
        return self._streams.cancel_live(request_id)

    def stats(self) -> RuntimeStats:
        """Counters of every actor now (read between messages, on the loop: a consistent view)."""
        system = self._require_system()
        actors: dict[str, Stats] = {}
        for address in system.addresses():
            statistics = getattr(system.core(address), "statistics", None)
            if statistics is not None:
                actors[address] = statistics()
        return RuntimeStats(actors=actors, dead_letters=dict(system.dead_letters))

    async def wait_progress(self) -> None:
        """Wait until an actor next handles a message or stops; raises ``RuntimeClosed``.

        ``stats()`` changes only then: a test or monitor waiting for a condition on it checks,
        awaits this, and checks again (``runtime.testing.harness.wait_until``), never spinning.
        """
        await self._require_system().wait_progress()

    # ------------------------------------------------------------------ plumbing

    def _require_system(self) -> ActorSystem:
        if self._system is None:
            raise RuntimeClosed("the Runtime is not running; use `async with Runtime(...) as rt`")
        return self._system

    async def _ask(self, message: Message) -> Message:
        return await self._require_system().ask(ROUTER, message)

    @property
    def unrouted_events(self) -> Counter[str]:
        """Host events that reached no stream (their request had already ended), by type."""
        return self._streams.unrouted


def _expect(reply: Message, kind: type[_T]) -> _T:
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, CommandFailed):
        raise error_for_code(reply.code, reply.message)
    raise MlxRuntimeError(f"unexpected reply {type(reply).__name__}")


__all__ = [
    "Completion",
    "GenerateOptions",
    "GenerationStream",
    "InvalidRequest",
    "PrewarmOptions",
    "Request",
    "Runtime",
    "RuntimeStats",
]
