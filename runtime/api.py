"""The host API: ``Runtime``, an async context manager that runs the actors on the host's loop.

Everything a host does is a message to the router; this module only turns those messages into
awaitables and per-request event streams. See docs/api.md.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import TypeVar

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from actors.standing import standing_actors
from runtime.backends.loader import make_backend_loader
from runtime.backends.options import decode_options
from runtime.config import RuntimeConfig
from runtime.errors import InvalidRequest, MlxRuntimeError, RuntimeClosed, error_for_code
from runtime.kernel.actor import ActorSystem
from runtime.kernel.core import ROUTER, Address
from runtime.messages import (
    Cancel,
    Cancelled,
    ChatMessage,
    ChatOptions,
    CommandFailed,
    EndSession,
    Failed,
    Finished,
    Generate,
    HostEvent,
    LoadModel,
    Message,
    ModelLoaded,
    ModelSpec,
    ModelUnloaded,
    PrefixesReset,
    Prewarm,
    Rejected,
    ResetPrefixes,
    Sampling,
    SessionEnded,
    Shutdown,
    Started,
    Stats,
    TokensEmitted,
    UnloadModel,
    Usage,
)
from runtime.text.coalesce import Chunk, CoalescePolicy, Coalescer
from runtime.validation import validate_request

HOST: Address = "host"
_T = TypeVar("_T")
TERMINALS = (Finished, Cancelled, Failed)
CLOSE_WAIT_S = 10.0  # a safety net only: an engine answers an abort within one step
SHUTDOWN_WAIT_S = 30.0  # leaving the Runtime waits this long for models to unload, then stops all

log = logging.getLogger("mlx_actor_runtime.api")


class RuntimeStats(msgspec.Struct, frozen=True, kw_only=True):
    """An immutable snapshot of every actor's counters, plus messages dropped on purpose."""

    actors: dict[str, Stats]
    dead_letters: dict[str, int]


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """What ``Runtime.complete`` returns: the whole output and how the request ended."""

    text: str
    token_ids: tuple[int, ...]
    started: Started | None
    terminal: Finished | Cancelled | Failed

    @property
    def usage(self) -> Usage:
        return self.terminal.usage


class GenerationStream:
    """The events of one request. Use as ``async with rt.generate(...) as stream``.

    Leaving the block before the terminal event (``break``, an exception, or cancellation of the
    consuming task) cancels the request at once; nothing waits for garbage collection.
    """

    def __init__(
        self, runtime: Runtime, request: Generate | Prewarm, coalesce: CoalescePolicy
    ) -> None:
        self._runtime = runtime
        self.request = request
        self._receive: MemoryObjectReceiveStream[HostEvent] | None = None
        self._terminal: HostEvent | None = None
        self._coalescer = Coalescer(coalesce)
        self._held: HostEvent | None = None  # a non-token event waiting behind a flushed chunk

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def __aenter__(self) -> GenerationStream:
        self._receive = await self._runtime._submit(self.request)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel the request unless it already ended, and wait (shielded) for its end.

        The wait is one prefill chunk or decode step at most; afterwards the request id is free.
        """
        if self._receive is None:
            return
        if self._terminal is None and not isinstance(self._held, (*TERMINALS, Rejected)):
            self._runtime._tell(Cancel(request_id=self.request_id, incarnation=self._incarnation))
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_WAIT_S):
                async for event in self._receive:
                    if isinstance(event, (*TERMINALS, Rejected)):
                        break
        self._runtime._forget(self.request)
        self._receive.close()

    @property
    def _incarnation(self) -> int:
        return self.request.incarnation

    def __aiter__(self) -> AsyncIterator[HostEvent]:
        return self

    async def __anext__(self) -> HostEvent:
        if self._receive is None:
            raise RuntimeError("use `async with rt.generate(...) as stream:` to iterate events")
        if self._terminal is not None:
            raise StopAsyncIteration
        if self._held is not None:
            event, self._held = self._held, None
        else:
            event = await self._next_coalesced(self._receive)
        if isinstance(event, Rejected):
            self._terminal = event
            raise error_for_code(event.code, event.message)
        if isinstance(event, TERMINALS):
            self._terminal = event
        return event

    async def _next_coalesced(self, receive: MemoryObjectReceiveStream[HostEvent]) -> HostEvent:
        """The next event, with token events merged by the coalescing policy (size or age)."""
        while True:
            deadline = self._coalescer.next_deadline()
            wait = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            with anyio.move_on_after(wait):
                try:
                    event = await receive.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    raise StopAsyncIteration from None
                if isinstance(event, TokensEmitted) and not self._coalescer.policy.enabled:
                    return event  # one event per token, logprobs and all
                if not isinstance(event, TokensEmitted):
                    chunk = self._coalescer.flush()  # never let a token trail a later event
                    if chunk is None:
                        return event
                    self._held = event
                    return self._as_event(chunk)
                chunk = self._coalescer.add(event.text, event.token_ids, time.monotonic())
                if chunk is not None:
                    return self._as_event(chunk)
                continue
            chunk = self._coalescer.due(time.monotonic())
            if chunk is not None:
                return self._as_event(chunk)

    def _as_event(self, chunk: Chunk) -> TokensEmitted:
        return TokensEmitted(
            request_id=self.request_id,
            incarnation=self._incarnation,
            token_ids=chunk.token_ids,
            text=chunk.text,
        )


class Runtime:
    """An embedded inference runtime. ``async with Runtime(config) as rt: ...``."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = config or RuntimeConfig()
        self._system: ActorSystem | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._streams: dict[tuple[str, int], MemoryObjectSendStream[HostEvent]] = {}
        self._live_incarnation: dict[str, int] = {}
        self._incarnations = itertools.count(1)
        self.unrouted_events: Counter[str] = Counter()

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Runtime:
        stack = contextlib.AsyncExitStack()
        task_group = await stack.enter_async_context(anyio.create_task_group())
        system = ActorSystem(task_group, child_policy=self.config.engine_restart)
        system.register_sink(HOST, self._on_event)
        for address, core in standing_actors(
            kv_budget_bytes=self.config.resolved_kv_budget_bytes(),
            load_backend=make_backend_loader(),
            reservation_timeout_s=self.config.reservation_timeout_s,
            default_max_tokens=self.config.default_max_tokens,
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

    # ------------------------------------------------------------------ models

    async def load_model(self, spec: ModelSpec) -> ModelLoaded:
        """Load a model; raises ``ModelAlreadyLoaded``, ``ModelLoadFailed`` or ``InvalidModelSpec``.

        The reply says which prefix-reuse path the model uses and its KV bytes per token. A spec
        whose options do not decode (an unknown name, a wrong type) raises before anything loads.
        """
        decode_options(spec)
        reply = await self._ask(LoadModel(spec=spec))
        return _expect(reply, ModelLoaded)

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
        self,
        model: str,
        prompt: str | None = None,
        *,
        prompt_tokens: tuple[int, ...] | list[int] | None = None,
        messages: Sequence[ChatMessage] | None = None,
        chat: ChatOptions | None = None,
        max_tokens: int | None = None,
        sampling: Sampling | None = None,
        stop: tuple[str, ...] | list[str] = (),
        stop_token_ids: tuple[int, ...] = (),
        namespace: str = "default",
        session: str | None = None,
        request_id: str | None = None,
        coalesce: CoalescePolicy | None = None,
        supersede: bool = False,
    ) -> GenerationStream:
        """A stream of this request's events; raises ``InvalidRequest`` on malformed input."""
        request = Generate(
            request_id=request_id or uuid.uuid4().hex,
            incarnation=next(self._incarnations),
            model=model,
            prompt=prompt,
            prompt_tokens=None if prompt_tokens is None else tuple(prompt_tokens),
            messages=None if messages is None else tuple(messages),
            chat=chat or ChatOptions(),
            sampling=sampling or Sampling(),
            max_tokens=max_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_token_ids),
            namespace=namespace,
            session=session,
            supersede=supersede,
        )
        validate_request(request)
        policy = coalesce or self.config.coalesce
        if request.sampling.logprobs:  # one event per token, so each carries its logprobs
            policy = CoalescePolicy(enabled=False)
        return GenerationStream(self, request, policy)

    async def complete(self, model: str, prompt: str | None = None, **kwargs: object) -> Completion:
        """Run ``generate`` to its end and collect the output."""
        texts: list[str] = []
        tokens: list[int] = []
        started: Started | None = None
        async with self.generate(model, prompt, **kwargs) as stream:  # type: ignore[arg-type]
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
        self,
        model: str,
        prompt: str | None = None,
        *,
        prompt_tokens: tuple[int, ...] | list[int] | None = None,
        messages: Sequence[ChatMessage] | None = None,
        chat: ChatOptions | None = None,
        max_tokens: int | None = None,
        namespace: str = "default",
        session: str | None = None,
        request_id: str | None = None,
    ) -> Finished | Cancelled | Failed:
        """Prefill and cache a prompt without sampling; returns how the warmup ended.

        ``Finished(reason="prewarmed")`` when cached, ``"adopted"`` when a generate took it over,
        ``Cancelled(reason="superseded")`` when a diverging generate replaced it.
        """
        request = Prewarm(
            request_id=request_id or uuid.uuid4().hex,
            incarnation=next(self._incarnations),
            model=model,
            prompt=prompt,
            prompt_tokens=None if prompt_tokens is None else tuple(prompt_tokens),
            messages=None if messages is None else tuple(messages),
            chat=chat or ChatOptions(),
            max_tokens=max_tokens,
            namespace=namespace,
            session=session,
        )
        validate_request(request)
        async with GenerationStream(self, request, CoalescePolicy(enabled=False)) as stream:
            async for event in stream:
                if isinstance(event, TERMINALS):
                    return event
        raise RuntimeClosed("the runtime closed before the prewarm ended")

    async def cancel(self, request_id: str) -> bool:
        """Cancel the live request with this id; False (a no-op) if none is live."""
        incarnation = self._live_incarnation.get(request_id)
        if incarnation is None:
            return False
        self._tell(Cancel(request_id=request_id, incarnation=incarnation))
        return True

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

    def _tell(self, message: Message) -> None:
        if self._system is not None:
            self._system.tell(ROUTER, message, sender=HOST)

    async def _submit(self, request: Generate | Prewarm) -> MemoryObjectReceiveStream[HostEvent]:
        system = self._require_system()
        key = (request.request_id, request.incarnation)
        send, receive = anyio.create_memory_object_stream[HostEvent](math.inf)
        self._streams[key] = send
        self._live_incarnation[request.request_id] = request.incarnation
        try:
            await system.tell_external(ROUTER, request, sender=HOST)
        except BaseException:
            # Cancelled (or refused) while waiting for mailbox space: never submitted, so no
            # terminal will ever come to unregister it.
            self._forget(request)
            receive.close()
            raise
        return receive

    def _forget(self, request: Generate | Prewarm) -> None:
        send = self._streams.pop((request.request_id, request.incarnation), None)
        if send is not None:
            send.close()
        if self._live_incarnation.get(request.request_id) == request.incarnation:
            del self._live_incarnation[request.request_id]

    def _on_event(self, message: Message, _sender: Address) -> None:
        key = (getattr(message, "request_id", ""), getattr(message, "incarnation", -1))
        send = self._streams.get(key)
        if send is None:
            self.unrouted_events[type(message).__name__] += 1
            return
        send.send_nowait(message)  # type: ignore[arg-type]
        if isinstance(message, (*TERMINALS, Rejected)):
            if self._live_incarnation.get(key[0]) == key[1]:
                del self._live_incarnation[key[0]]
            send.close()


def _expect(reply: Message, kind: type[_T]) -> _T:
    if isinstance(reply, kind):
        return reply
    if isinstance(reply, CommandFailed):
        raise error_for_code(reply.code, reply.message)
    raise MlxRuntimeError(f"unexpected reply {type(reply).__name__}")


__all__ = ["Completion", "GenerationStream", "InvalidRequest", "Runtime", "RuntimeStats"]
