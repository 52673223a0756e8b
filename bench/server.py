"""``mlx_lm.server`` as a subprocess on 127.0.0.1, driven through streaming /v1/completions.

The server takes text prompts (it tokenizes them itself), so turn 2 is the text of turn 1, the
reply's text and the follow-up. Its own prompt cache (an LRU of KV caches) decides any reuse; the
``cached_tokens`` it reports in ``usage`` show what it reused. It runs with its default settings
(``--prefill-step-size 2048``), as a person starting it by hand would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.results import Measurement, decode_rate, ratio, timed
from bench.workload import Workload

SYSTEM = "mlx_lm.server"
HOST = "127.0.0.1"
THINK_TIME_S = 0.05  # pause between turns, the same for every system
READY_TIMEOUT_S = 90.0
REQUEST_TIMEOUT_S = 60.0


class ServerUnavailable(RuntimeError):
    """The server could not be started or did not become ready (the message says why)."""


@dataclass
class Reply:
    """One streamed completion: text chunks with their times (from submission) and usage."""

    chunks: list[tuple[float, str]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float:
        return self.chunks[0][0]

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.chunks)

    @property
    def cached_tokens(self) -> int | None:
        details = self.usage.get("prompt_tokens_details") or {}
        value = details.get("cached_tokens")
        return None if value is None else int(value)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running_server(model_dir: Path) -> Iterator[int]:
    """Start the server, wait until /health answers, yield its port; always stop it."""
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
    command += ["--host", HOST, "--port", str(port), "--log-level", "WARNING"]
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_ready(process, port, log)
            yield port
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def _wait_ready(process: subprocess.Popen[bytes], port: int, log: Any) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:]
            raise ServerUnavailable(f"exited with {process.returncode} before ready: {tail}")
        try:
            if asyncio.run(_get_status(port, "/health")) == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise ServerUnavailable(f"no 200 from /health within {READY_TIMEOUT_S:.0f}s")


async def _get_status(port: int, path: str) -> int:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 2.0)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 2.0)
        return int(status.split()[1])
    finally:
        writer.close()


async def _open_completion(
    port: int, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a POST /v1/completions; returns the connection with the response not yet read."""
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 5.0)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    await writer.drain()
    return reader, writer


async def _read_reply(reader: asyncio.StreamReader, start: float) -> Reply:
    reply = Reply()
    status = await reader.readline()
    if not status.startswith(b"HTTP/") or status.split()[1] != b"200":
        raise ServerUnavailable(f"unexpected response {status!r}")
    while (await reader.readline()).strip():
        pass  # headers
    async for raw in reader:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue  # blank separators and ": keepalive" comments
        event = json.loads(line[6:])
        if event.get("usage"):
            reply.usage = event["usage"]
        for choice in event.get("choices") or []:
            if choice.get("text"):
                reply.chunks.append((time.perf_counter() - start, choice["text"]))
    return reply


async def complete(port: int, prompt: str, max_tokens: int, start: float | None = None) -> Reply:
    """A streamed greedy completion, bounded by ``REQUEST_TIMEOUT_S``."""
    start = time.perf_counter() if start is None else start
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reader, writer = await _open_completion(port, body)
    try:
        return await asyncio.wait_for(_read_reply(reader, start), REQUEST_TIMEOUT_S)
    finally:
        writer.close()


async def abandoned_then_short(port: int, long: str, short: str, delay_s: float) -> float:
    """Send ``long``, close the connection after ``delay_s``, send ``short`` at once.

    Returns the short request's TTFT counted from the moment the long one's connection closed.
    """
    _, writer = await _open_completion(
        port, {"prompt": long, "max_tokens": 1, "temperature": 0.0, "stream": True}
    )
    await asyncio.sleep(delay_s)
    writer.transport.abort()  # drop the connection now, as a client that went away
    left = time.perf_counter()
    return (await complete(port, short, 2, start=left)).ttft


async def _measure(port: int, name: str, work: Workload) -> list[Measurement]:
    sizes = work.sizes
    await complete(port, work.warmup.text, 2)  # the first request also loads the model

    cold, warm, cached_cold, cached_warm = [], [], [], []
    for turn1, followup in zip(work.conversations, work.followups, strict=True):
        first = await complete(port, turn1.text, sizes.reply_tokens)
        cold.append(first.ttft)
        cached_cold.append(first.cached_tokens)
        await asyncio.sleep(THINK_TIME_S)
        second = await complete(port, turn1.text + first.text + followup.text, 1)
        warm.append(second.ttft)
        cached_warm.append(second.cached_tokens)
        prompt_tokens = int(second.usage.get("prompt_tokens", 0))
        cold_prompt_tokens = int(first.usage.get("prompt_tokens", 0))

    long_cold, idle, after = [], [], []
    for long, long2, s_idle, s_after in zip(
        work.longs, work.longs_abandoned, work.shorts_idle, work.shorts_after, strict=True
    ):
        long_cold.append((await complete(port, long.text, 1)).ttft)
        idle.append((await complete(port, s_idle.text, 2)).ttft)
        delay = sizes.abandon_fraction * long_cold[-1]
        after.append(await abandoned_then_short(port, long2.text, s_after.text, delay))

    rates = []
    for prompt in work.decode:
        reply = await complete(port, prompt.text, sizes.decode_tokens)
        produced = int(reply.usage.get("completion_tokens", 0))
        first_chunk_tokens = 1  # the first chunk carries (at least) the first token
        span = reply.chunks[-1][0] - reply.chunks[0][0]
        rates.append((produced - first_chunk_tokens) / span if span > 0 else float("nan"))

    cold_m = timed(SYSTEM, name, "turn2.cold_ttft", cold)
    warm_m = timed(SYSTEM, name, "turn2.warm_ttft", warm)
    idle_m = timed(SYSTEM, name, "abandon.short_idle_ttft", idle)
    after_m = timed(SYSTEM, name, "abandon.short_after_ttft", after)
    warm_cached, cold_cached = cached_warm[-1], cached_cold[-1]
    return [
        cold_m,
        warm_m,
        ratio(SYSTEM, name, "turn2.cold/warm", cold_m.value, warm_m.value),
        Measurement(
            SYSTEM,
            name,
            "turn2.prefilled_cold",
            None if cold_cached is None else float(cold_prompt_tokens - cold_cached),
            "tokens",
        ),
        Measurement(
            SYSTEM,
            name,
            "turn2.prefilled_warm",
            None if warm_cached is None else float(prompt_tokens - warm_cached),
            "tokens",
            note=f"prompt_tokens - usage cached_tokens (turn-2 prompt {prompt_tokens} tokens, "
            f"cached {cached_warm})",
        ),
        timed(SYSTEM, name, "abandon.long_cold_ttft", long_cold),
        idle_m,
        after_m,
        ratio(SYSTEM, name, "abandon.after/idle", after_m.value, idle_m.value),
        decode_rate(
            SYSTEM, name, rates, note="usage completion_tokens over the span of streamed chunks"
        ),
    ]


def measure(model_dir: Path, name: str, work: Workload) -> list[Measurement]:
    """All server measurements for one model, or one row saying why the server was skipped."""
    try:
        with running_server(model_dir) as port:
            return asyncio.run(_measure(port, name, work))
    except (ServerUnavailable, OSError, TimeoutError) as exc:
        reason = f"skipped: {type(exc).__name__}: {exc}"
        return [Measurement(SYSTEM, name, "skipped", None, "-", note=reason)]
