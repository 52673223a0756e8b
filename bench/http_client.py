"""The one HTTP client the bench drives every server with: streamed ``/v1/completions`` and JSON.

Plain asyncio sockets, one connection per request (``Connection: close``), so dropping a stream
closes its socket, as a client that went away would. Times are taken as each SSE event is parsed.
A body may be chunked (uvicorn) or end with the connection (``mlx_lm.server``'s HTTP/1.0 handler).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
CONNECT_TIMEOUT_S = 5.0
REQUEST_TIMEOUT_S = 300.0  # a long prompt on a real model, behind other requests, on a busy CPU


# The systems that are our runtime behind its HTTP API, on either backend: they take our extra
# fields (``session``) and endpoints (``/v1/prewarm``).
OUR_SYSTEMS = ("runtime", "ours-llamacpp")


def speaks_our_api(system: str) -> bool:
    """Whether ``system`` is our ``mlxrt serve`` (any backend), with our fields and endpoints."""
    return system in OUR_SYSTEMS


class RequestFailed(RuntimeError):
    """A server answered with something other than a 200 and a well-formed stream."""


@dataclass(frozen=True)
class Server:
    """A running server: which system it is, where, and the ``model`` its requests name."""

    system: str
    port: int
    model: str


def in_turn(servers: Sequence[Server], repetition: int) -> list[Server]:
    """The order to drive ``servers`` in on ``repetition``: reversed every other time, so none
    always goes first while the shared CPU's load drifts."""
    return list(servers if repetition % 2 == 0 else reversed(servers))


@dataclass
class Reply:
    """One streamed completion: text chunks with their times (seconds from ``start``), usage."""

    chunks: list[tuple[float, str]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)  # llama-server's per-request counters
    finished_s: float | None = None  # when the chunk with the finish_reason arrived

    @property
    def ttft(self) -> float:
        """Time to the first text, or to the end for a reply with no text at all."""
        if self.chunks:
            return self.chunks[0][0]
        if self.finished_s is None:
            raise RequestFailed("a 200 whose stream ended without text or a finish_reason")
        return self.finished_s

    @property
    def prompt_eval_s(self) -> float | None:
        """The server's own prompt time (``timings.prompt_ms``), None where it does not say."""
        ms = self.timings.get("prompt_ms")
        return None if ms is None else float(ms) / 1000

    @property
    def last_token_s(self) -> float:
        """Time of the last text, or of the end for a reply with no text at all."""
        return self.chunks[-1][0] if self.chunks else self.ttft

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens", 0))

    @property
    def completion_tokens(self) -> int:
        return int(self.usage.get("completion_tokens", 0))

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return None if value is None else int(value)

    @property
    def prefilled_tokens(self) -> int | None:
        """Prompt tokens the server computed for this request, None where it does not say.

        llama-server counts them itself (``timings.prompt_n``); the others report the
        ``cached_tokens`` they reused, so the rest of the prompt is what they computed.
        """
        if "prompt_n" in self.timings:
            return int(self.timings["prompt_n"])
        cached = self.cached_tokens
        return None if cached is None else self.prompt_tokens - cached


class CompletionStream:
    """A streamed completion in flight; ``reply`` fills while a task reads its events."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, start: float):
        self.reply = Reply()
        self._start = start
        self._writer = writer
        self._answered = asyncio.Event()  # the first text or the end arrived
        self._reading = asyncio.create_task(self._read(reader))

    async def first_text(self) -> float:
        """Seconds from ``start`` to the first text (or the end); raises what the read raised."""
        await asyncio.wait_for(self._answered.wait(), REQUEST_TIMEOUT_S)
        if self._reading.done() and self._reading.exception() is not None:
            await self._reading
        return self.reply.ttft

    async def finish(self) -> Reply:
        """Read to the end of the stream."""
        try:
            await asyncio.wait_for(self._reading, REQUEST_TIMEOUT_S)
        finally:
            self._writer.close()
        return self.reply

    def drop(self) -> None:
        """Close the connection now, unread, as a client that went away."""
        self._reading.cancel()
        self._writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            async for event in _events(reader):
                if "error" in event:
                    raise RequestFailed(f"error event: {event['error']}")
                if event.get("usage"):
                    self.reply.usage = event["usage"]
                if event.get("timings"):
                    self.reply.timings = event["timings"]
                for choice in event.get("choices") or []:
                    now = time.perf_counter() - self._start
                    if choice.get("text"):
                        self.reply.chunks.append((now, choice["text"]))
                        self._answered.set()
                    if choice.get("finish_reason"):
                        self.reply.finished_s = now
        finally:
            self._answered.set()


async def open_completion(
    server: Server,
    prompt: str,
    max_tokens: int,
    *,
    start: float | None = None,
    extra: dict[str, Any] | None = None,
) -> CompletionStream:
    """Send a greedy streamed completion (with usage); times count from ``start`` (default now).

    ``extra``: fields only ``server``'s system understands (our ``session``).
    """
    start = time.perf_counter() if start is None else start
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    reader, writer = await _post(server, "/v1/completions", body)
    return CompletionStream(reader, writer, start)


async def complete(
    server: Server,
    prompt: str,
    max_tokens: int,
    *,
    start: float | None = None,
    extra: dict[str, Any] | None = None,
) -> Reply:
    """A streamed greedy completion read to its end."""
    stream = await open_completion(server, prompt, max_tokens, start=start, extra=extra)
    return await stream.finish()


async def post_json(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` to ``path`` and return the JSON answer (a 200 only)."""
    reader, writer = await _post(server, path, body)
    try:
        length, chunked = await asyncio.wait_for(_head(reader), REQUEST_TIMEOUT_S)
        if chunked:
            raw = b"".join([piece async for piece in _chunks(reader)])
        elif length is not None:
            raw = await reader.readexactly(length)
        else:
            raw = await reader.read()
        answer: dict[str, Any] = json.loads(raw)
        return answer
    finally:
        writer.close()


async def _post(
    server: Server, path: str, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    payload = json.dumps(body).encode()
    connecting = asyncio.open_connection(HOST, server.port)
    reader, writer = await asyncio.wait_for(connecting, CONNECT_TIMEOUT_S)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    await writer.drain()
    return reader, writer


async def _head(reader: asyncio.StreamReader) -> tuple[int | None, bool]:
    """Read the status line and headers: (Content-Length or None, whether chunked)."""
    status = await reader.readline()
    if not status.startswith(b"HTTP/") or status.split()[1:2] != [b"200"]:
        rest = await asyncio.wait_for(reader.read(), CONNECT_TIMEOUT_S)  # errors are short
        body = rest.partition(b"\r\n\r\n")[2]
        raise RequestFailed(
            f"{status.decode('latin-1').strip()}: {body[:300].decode(errors='replace')}"
        )
    length, chunked = None, False
    while line := (await reader.readline()).strip():
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
        elif name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    return length, chunked


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The pieces of a chunked body, in order."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        piece = await reader.readexactly(size)
        await reader.readline()  # the CRLF after each chunk
        yield piece


async def _lines(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    _, chunked = await _head(reader)
    if not chunked:
        async for line in reader:
            yield line
        return
    pending = b""
    async for piece in _chunks(reader):
        pending += piece
        *complete_lines, pending = pending.split(b"\n")
        for line in complete_lines:
            yield line
    if pending:
        yield pending


async def _events(reader: asyncio.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each ``data:`` line, up to ``[DONE]`` (comments and blank lines skipped)."""
    async for raw in _lines(reader):
        line = raw.strip()
        if line == b"data: [DONE]":
            return
        if line.startswith(b"data: "):
            try:
                event = json.loads(line[6:])
            except json.JSONDecodeError as exc:
                raise RequestFailed(f"malformed event {line[:200]!r}") from exc
            yield event
