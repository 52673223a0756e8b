"""Per-request event streams on the host side: routing host events to their request's stream,
and the stream a host iterates (``GenerationStream``), with token events coalesced.

Every event for a request carries ``(request_id, incarnation)``; ``HostStreams`` is the host
sink that delivers each to its stream, so a late event of an ended request (a reused id's older
incarnation) never reaches the new one: it is counted as unrouted instead.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from types import TracebackType

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from runtime.errors import RuntimeClosed, error_for_code
from runtime.kernel.actor import ActorSystem
from runtime.kernel.core import ROUTER, Address
from runtime.messages import (
    Cancel,
    Cancelled,
    Failed,
    Finished,
    Generate,
    HostEvent,
    Message,
    Prewarm,
    Rejected,
    Started,
    TokensEmitted,
    Usage,
)
from runtime.text.coalesce import Chunk, CoalescePolicy, Coalescer

HOST: Address = "host"
TERMINALS = (Finished, Cancelled, Failed)
CLOSE_WAIT_S = 10.0  # a safety net only: an engine answers an abort within one step


class HostStreams:
    """The host's end of every live request: one memory stream per ``(request_id, incarnation)``.

    ``system`` returns the running actor system or raises ``RuntimeClosed``.
    """

    def __init__(self, system: Callable[[], ActorSystem]) -> None:
        self._system = system
        self._streams: dict[tuple[str, int], MemoryObjectSendStream[HostEvent]] = {}
        # Every incarnation of an id not yet ended: a refused duplicate must not hide the live one.
        self._open_incarnations: dict[str, set[int]] = {}
        self.unrouted: Counter[str] = Counter()

    async def open(self, request: Generate | Prewarm) -> MemoryObjectReceiveStream[HostEvent]:
        """Register the request's stream, then submit it (waiting for router mailbox space)."""
        system = self._system()
        key = (request.request_id, request.incarnation)
        send, receive = anyio.create_memory_object_stream[HostEvent](math.inf)
        self._streams[key] = send
        self._open_incarnations.setdefault(request.request_id, set()).add(request.incarnation)
        try:
            await system.tell_external(ROUTER, request, sender=HOST)
        except BaseException:
            # Cancelled (or refused) while waiting for mailbox space: never submitted, so no
            # terminal will ever come to unregister it.
            self.forget(request)
            receive.close()
            raise
        return receive

    def cancel(self, request: Generate | Prewarm) -> None:
        """Ask the router to cancel this incarnation of the request (a no-op once closed)."""
        self._tell(Cancel(request_id=request.request_id, incarnation=request.incarnation))

    def cancel_live(self, request_id: str) -> bool:
        """Cancel the live incarnation of ``request_id``; False if none is live.

        At most one incarnation is live at the router; a cancel for any other is a no-op there.
        """
        incarnations = self._open_incarnations.get(request_id)
        if not incarnations:
            return False
        for incarnation in sorted(incarnations):
            self._tell(Cancel(request_id=request_id, incarnation=incarnation))
        return True

    def forget(self, request: Generate | Prewarm) -> None:
        """Unregister the request's stream: later events for it are unrouted."""
        send = self._streams.pop((request.request_id, request.incarnation), None)
        if send is not None:
            send.close()
        self._ended(request.request_id, request.incarnation)

    def deliver(self, message: Message, _sender: Address) -> None:
        """The host sink: hand an event to its request's stream; close it after the terminal."""
        key = (getattr(message, "request_id", ""), getattr(message, "incarnation", -1))
        send = self._streams.get(key)
        if send is None:
            self.unrouted[type(message).__name__] += 1
            return
        send.send_nowait(message)  # type: ignore[arg-type]
        if isinstance(message, (*TERMINALS, Rejected)):
            self._ended(*key)
            send.close()

    def _ended(self, request_id: str, incarnation: int) -> None:
        incarnations = self._open_incarnations.get(request_id)
        if incarnations is not None:
            incarnations.discard(incarnation)
            if not incarnations:
                del self._open_incarnations[request_id]

    def _tell(self, message: Message) -> None:
        try:
            system = self._system()
        except RuntimeClosed:
            return  # the runtime has closed: every request has already ended
        system.tell(ROUTER, message, sender=HOST)


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
        self, streams: HostStreams, request: Generate | Prewarm, coalesce: CoalescePolicy
    ) -> None:
        self._streams = streams
        self.request = request
        self._receive: MemoryObjectReceiveStream[HostEvent] | None = None
        self._terminal: HostEvent | None = None
        self._coalescer = Coalescer(coalesce)
        self._held: HostEvent | None = None  # a non-token event waiting behind a flushed chunk

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def __aenter__(self) -> GenerationStream:
        self._receive = await self._streams.open(self.request)
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
            self._streams.cancel(self.request)
            with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_WAIT_S):
                async for event in self._receive:
                    if isinstance(event, (*TERMINALS, Rejected)):
                        break
        self._streams.forget(self.request)
        self._receive.close()

    def cancel(self) -> None:
        """Ask the runtime to end the request now, keeping the stream open: the events already
        on their way, then its ``Cancelled`` (with the usage so far), still come."""
        if self._receive is not None and self._terminal is None:
            self._streams.cancel(self.request)

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
