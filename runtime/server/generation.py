"""One HTTP request running one runtime request: answered as JSON or Server-Sent Events.

``GenerationResponse`` enters the ``GenerationStream`` and waits for the first text or the end
before it picks a status, so every failure up to the first token is a proper HTTP error; a stream
that fails later gets an SSE error event and no ``[DONE]``. At shutdown (a ``ShutdownNotice``) the
answer stops where it is and ends properly: a stream with ``stopped`` chunks and ``[DONE]``, an
unanswered request with a 503. A disconnect cancels the response, and leaving the
``GenerationStream`` cancels the runtime request at its next boundary (quietly: ``Cancelled``, its
KV released). See docs/http.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import anyio
import msgspec
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from runtime.errors import MlxRuntimeError, ModelNotLoaded, RuntimeClosed
from runtime.host.streams import GenerationStream
from runtime.messages import (
    Cancelled,
    Failed,
    Finished,
    FinishReason,
    Rejected,
    Started,
    TokensEmitted,
    Usage,
)
from runtime.server.errors import (
    HttpError,
    error_for_cancelled,
    error_for_code,
    error_for_failed,
    error_for_runtime,
    model_not_loaded,
)
from runtime.server.metrics import StreamTimer
from runtime.server.render import Render
from runtime.server.replies import Chunk, encoder
from runtime.server.shutdown import ShutdownNotice, shutting_down

log = logging.getLogger("mlx_actor_runtime.server")

Output = TokensEmitted | Finished | Cancelled | Failed | Rejected | None  # None: no terminal came
DONE = b"data: [DONE]\n\n"


class GenerationResponse(Response):
    """Runs ``stream`` and answers with ``render``'s JSON (or SSE chunks when ``streaming``).

    A Starlette ``Response`` only so endpoints can return it; it writes its own messages.
    """

    def __init__(
        self,
        stream: GenerationStream,
        render: Render,
        *,
        streaming: bool,
        timer: StreamTimer | None = None,
        shutdown: ShutdownNotice | None = None,
    ) -> None:
        self.status_code = 200
        self.background = None
        self._stream = stream
        self._render = render
        self._streaming = streaming
        self._headers_sent = False
        self._timer = timer
        self._shutdown = shutdown
        self._stopped = False  # the shutdown stopped the answer: it still owes its ending
        self._answered = False
        self._cut_short = False  # the render ended the reply early: the request was cancelled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._shutdown is not None:
            self._shutdown.opened()
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(_cancel_on_disconnect, receive, task_group.cancel_scope)
                with anyio.CancelScope() as answering:
                    if self._shutdown is not None:
                        task_group.start_soon(self._stop_on_shutdown, self._shutdown, answering)
                    try:
                        await self._answer(send)
                        self._answered = True
                    except anyio.get_cancelled_exc_class():
                        if not self._stopped:
                            log.debug("client went away: request %s cancelled", self.request_id)
                            self._record_outcome("disconnected")
                        raise
                if self._stopped:
                    await self._send_shutdown_ending(send)
                task_group.cancel_scope.cancel()
        finally:
            if self._shutdown is not None:
                self._shutdown.closed()

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    async def _stop_on_shutdown(
        self, shutdown: ShutdownNotice, answering: anyio.CancelScope
    ) -> None:
        await shutdown.wait_given()
        if not self._answered:  # an answer already sent whole owes nothing more
            self._stopped = True
            answering.cancel()

    async def _send_shutdown_ending(self, send: Send) -> None:
        """The answer the shutdown owes: a stream's last chunk and ``[DONE]``, else a 503."""
        self._record_outcome("cancelled")
        error = shutting_down()
        log.info("request %s ended by the shutdown", self.request_id)
        if not self._headers_sent:
            await self._send_error(send, error)
            return
        detail = error.body().error
        await _send_chunks(send, self._render.stopped(detail), last=DONE)

    async def _answer(self, send: Send) -> None:
        try:
            async with self._stream as stream:
                first = await self._next_output(stream)
                if not isinstance(first, TokensEmitted | Finished):
                    await self._send_error(send, self._error_for(first))
                elif self._streaming:
                    await self._send_events(send, stream, first)
                else:
                    await self._send_whole(send, stream, first)
        except ModelNotLoaded:
            self._record_outcome("rejected")
            await self._send_error(send, model_not_loaded(self._render.model))
        except MlxRuntimeError as error:  # rejected otherwise, or the runtime is closing
            self._record_outcome("rejected")
            await self._send_error(send, error_for_runtime(error))

    async def _next_output(self, stream: GenerationStream) -> Output:
        """The next text or terminal event, observed by the timer (metrics) and the response's
        clock (timings) on its way; ``Started`` goes to the render."""
        output = await _next_output(stream, self._render.started)
        if isinstance(output, TokensEmitted):
            self._render.observe(output)
            if self._render.ended_early and not self._cut_short:
                self._cut_short = True
                stream.cancel()  # the reply is complete: the rest is not needed
        elif isinstance(output, Cancelled) and self._cut_short:  # the cancel asked for above
            output = Finished(
                request_id=output.request_id,
                incarnation=output.incarnation,
                reason=FinishReason.STOP,
                usage=output.usage,
            )
        self._render.clock.saw(output)
        if isinstance(output, TokensEmitted):
            if self._timer is not None:
                self._timer.tokens_emitted(output)
        elif output is None:  # the runtime closed before a terminal came
            self._record_outcome("failed")
        elif isinstance(output, Rejected):
            self._record_outcome("rejected")
        else:
            self._record_outcome(type(output).__name__.lower(), output.usage)
        return output

    def _record_outcome(self, outcome: str, usage: Usage | None = None) -> None:
        if self._timer is not None:
            self._timer.ended(outcome, usage)

    async def _send_whole(
        self, send: Send, stream: GenerationStream, first: TokensEmitted | Finished
    ) -> None:
        emitted: list[TokensEmitted] = []
        output: Output = first
        while isinstance(output, TokensEmitted):
            emitted.append(output)
            output = await self._next_output(stream)
        if isinstance(output, Finished):
            await self._send_json(send, 200, self._render.whole(emitted, output))
        else:
            await self._send_error(send, self._error_for(output))

    async def _send_events(
        self, send: Send, stream: GenerationStream, first: TokensEmitted | Finished
    ) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._sse_headers()})
        self._headers_sent = True
        pending = self._render.opening()
        output: Output = first
        while isinstance(output, TokensEmitted):
            chunks = [*pending, *self._render.chunk(output)]
            if chunks:  # a parser may hold an event's text back (a tag that may be starting)
                await _send_chunks(send, chunks)
            pending = []
            output = await self._next_output(stream)
        if isinstance(output, Finished):
            await _send_chunks(send, [*pending, *self._render.closing(output)], last=DONE)
        else:
            await self._send_error(send, self._error_for(output))

    def _error_for(self, output: Output) -> HttpError:
        match output:
            case Failed():
                return error_for_failed(output, self._render.prompt_field)
            case Cancelled():
                return error_for_cancelled(output)
            case Rejected(code=code, message=message):
                return error_for_code(code, message, retryable=False)
            case _:
                closed = RuntimeClosed("the server is shutting down; the request did not finish")
                return error_for_runtime(closed)

    async def _send_error(self, send: Send, error: HttpError) -> None:
        if self._headers_sent:  # mid-stream: an SSE error event, then the end (no [DONE])
            body = b"data: " + error.encode() + b"\n\n"
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        headers = [(k.encode(), v.encode()) for k, v in error.headers().items()]
        await self._send_json(send, error.status, error.body(), headers)

    async def _send_json(
        self,
        send: Send,
        status: int,
        body: msgspec.Struct,
        headers: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        content = encoder.encode(body)
        start_headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(content)).encode()),
            (b"x-request-id", self._stream.request_id.encode()),
            *headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": start_headers})
        self._headers_sent = True
        await send({"type": "http.response.body", "body": content, "more_body": False})

    def _sse_headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies must pass chunks on as they come
            (b"x-request-id", self._stream.request_id.encode()),
        ]


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    # Not Starlette's own disconnect handling: on ASGI 2.4 servers it notices a gone client only
    # when a write fails, which a long prefill never attempts.
    while (await receive())["type"] != "http.disconnect":
        pass  # the body was read already; nothing else is expected but the disconnect
    scope.cancel()


async def _next_output(stream: GenerationStream, started: Callable[[Started], None]) -> Output:
    """The next text or terminal event; ``Started`` (nothing a client sees yet) goes to
    ``started``."""
    async for event in stream:
        if not isinstance(event, Started):
            return event
        started(event)
    return None


async def _send_chunks(send: Send, chunks: Sequence[Chunk], last: bytes | None = None) -> None:
    body = b"".join(b"data: " + encoder.encode(chunk) + b"\n\n" for chunk in chunks)
    if last is None:
        if not body:
            return  # all of the event's text is held back for now (a tag may be starting)
        await send({"type": "http.response.body", "body": body, "more_body": True})
    else:
        await send({"type": "http.response.body", "body": body + last, "more_body": False})
