"""A soak of the HTTP server on a real model: a few concurrent clients send a seeded mix of
completions and chats, streamed and not, and some go away mid-stream; afterwards every reply that
ran to its end equals the prompt's cold reply, the KV budget holds only prefix entries, and once
those are reset MLX's active memory is back to where it was before the soak.

The server (``OpenAIServer`` under uvicorn) runs in this process on a loopback port, so the soak
reads the runtime's stats and ``mx.get_active_memory()`` directly; the clients are real HTTP
connections. The cold replies come from the embedded ``Runtime`` behind the server, each prompt in
a namespace of its own (which shares no cached prefix). See docs/reliability.md, "Soak".
"""

from __future__ import annotations

import contextlib
import gc
import json
import random
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import uvicorn

from runtime.backends.model_source import default_model_spec
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, Finished, ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.harness import wait_until

# A prompt is (endpoint, text): completions send the text as the prompt, chats as one message.
PROMPTS = (
    ("completions", "The capital of France is"),
    ("completions", "Once upon a time, in a small village,"),
    ("completions", "def fibonacci(n):"),
    ("completions", "The three primary colours are"),
    ("completions", "Water boils at"),
    ("chat", "What is the capital of France?"),
    ("chat", "Name three fruits."),
    ("chat", "Say hello in Spanish."),
    ("chat", "What is two plus two?"),
    ("chat", "Write a haiku about the sea."),
)
# Active memory after the reset may differ from before by this much (docs/reliability.md, "Soak").
ACTIVE_MEMORY_TOLERANCE_BYTES = 1 << 20


@dataclass(frozen=True)
class HttpSoakConfig:
    """The size of an HTTP soak."""

    seed: int = 0
    requests: int = 200
    clients: int = 4
    max_tokens: int = 8
    # Of all requests. A streamed one's client leaves after its first chunk; a non-streamed one's
    # once the engine has done more work (a chunk or a step, of any request) after sending it.
    disconnect_rate: float = 0.2
    kv_budget_bytes: int = 256 << 20


@dataclass
class HttpOutcome:
    """One request as its client saw it."""

    prompt: int  # index into PROMPTS
    stream: bool
    disconnect: bool
    status: int = 0
    text: str = ""
    finish_reason: str | None = None


@dataclass
class HttpSoakReport:
    """What the soak saw; ``problems()`` names every failed check."""

    outcomes: list[HttpOutcome]
    cold: dict[int, str]
    seconds: float
    reserved_at_quiescence: int
    prefix_bytes_at_quiescence: int
    live_requests_at_quiescence: int
    engine_sequences_at_quiescence: int
    reserved_after_reset: int
    active_memory_baseline: int
    active_memory_after: int
    peak_memory: int
    engine_counters: dict[str, int] = field(default_factory=dict)
    keeper_counters: dict[str, int] = field(default_factory=dict)

    def problems(self) -> list[str]:
        found: list[str] = []
        if short := self.keeper_counters.get("transfer_short", 0):
            # An entry held more than its sequence had reserved: the KV price fell short.
            found.append(f"{short} transfers moved more KV than their sequence held")
        for i, o in enumerate(self.outcomes):
            if o.status != 200 and not (o.disconnect and o.status == 0):  # 0: left unanswered
                found.append(f"request {i} answered HTTP {o.status}")
            elif not o.disconnect and o.text != self.cold[o.prompt]:
                cold = self.cold[o.prompt]
                found.append(f"request {i} ({PROMPTS[o.prompt]}) gave {o.text!r}, cold {cold!r}")
        if self.reserved_at_quiescence != self.prefix_bytes_at_quiescence:
            found.append(
                f"KV reserved {self.reserved_at_quiescence} B at quiescence, prefix entries hold "
                f"{self.prefix_bytes_at_quiescence} B"
            )
        if self.live_requests_at_quiescence or self.engine_sequences_at_quiescence:
            found.append(
                f"{self.live_requests_at_quiescence} live requests, "
                f"{self.engine_sequences_at_quiescence} engine sequences at quiescence"
            )
        if self.reserved_after_reset:
            found.append(f"KV reserved {self.reserved_after_reset} B after the reset")
        if (
            abs(self.active_memory_after - self.active_memory_baseline)
            > ACTIVE_MEMORY_TOLERANCE_BYTES
        ):
            found.append(
                f"MLX active memory {self.active_memory_baseline} B before, "
                f"{self.active_memory_after} B after"
            )
        return found

    def tally(self) -> Counter[str]:
        """Requests by kind and ending: ``chat/stream/length``, ``completions/json/stop``..."""
        return Counter(
            f"{PROMPTS[o.prompt][0]}/{'stream' if o.stream else 'json'}/"
            f"{'disconnected' if o.disconnect else o.finish_reason}"
            for o in self.outcomes
        )


def plan(config: HttpSoakConfig) -> list[HttpOutcome]:
    """The seeded requests: prompt, streamed or not, and whether the client leaves mid-stream."""
    rng = random.Random(config.seed)
    planned = []
    for _ in range(config.requests):
        stream = rng.random() < 0.6
        planned.append(
            HttpOutcome(
                prompt=rng.randrange(len(PROMPTS)),
                stream=stream,
                disconnect=rng.random() < config.disconnect_rate,
            )
        )
    return planned


async def run_http_soak(config: HttpSoakConfig, spec: ModelSpec | None = None) -> HttpSoakReport:
    """Serve ``spec`` (the default model) on loopback, run the plan, and measure what is left."""
    import mlx.core as mx

    spec = spec or default_model_spec()
    server = OpenAIServer(
        ServerConfig(models=(spec,), runtime=RuntimeConfig(kv_budget_bytes=config.kv_budget_bytes))
    )
    outcomes = plan(config)
    async with serve_on_loopback(server) as client:
        rt = server.runtime
        cold = {
            i: await _cold_reply(rt, spec.name, i, config.max_tokens) for i in range(len(PROMPTS))
        }
        # The cold replies were the warm-up too: the baseline counts what MLX keeps after them.
        await _reset(rt, spec.name)
        active_baseline = _active_memory(mx)
        mx.reset_peak_memory()
        started = time.perf_counter()
        pending = iter(outcomes)
        async with anyio.create_task_group() as tg:
            for _ in range(config.clients):
                tg.start_soon(_client, client, rt, spec.name, config.max_tokens, pending)
        await wait_until(rt, lambda: _quiescent(rt), timeout=60, what="every request ended")
        seconds = time.perf_counter() - started
        actors = rt.stats().actors
        engines = [s for a, s in actors.items() if a.startswith("engine:")]
        report = HttpSoakReport(
            outcomes=outcomes,
            cold=cold,
            seconds=seconds,
            reserved_at_quiescence=actors["kv"].gauges["reserved"],
            prefix_bytes_at_quiescence=actors["prefix"].gauges["bytes"],
            live_requests_at_quiescence=actors["router"].gauges["live_requests"],
            engine_sequences_at_quiescence=sum(s.gauges["sequences"] for s in engines),
            reserved_after_reset=0,
            active_memory_baseline=active_baseline,
            active_memory_after=0,
            peak_memory=mx.get_peak_memory(),
            engine_counters=dict(engines[0].counters),
            keeper_counters=dict(actors["kv"].counters),
        )
        await _reset(rt, spec.name)
        report.reserved_after_reset = rt.stats().actors["kv"].gauges["reserved"]
        report.active_memory_after = _active_memory(mx)
    return report


async def _cold_reply(rt: Runtime, model: str, prompt: int, max_tokens: int) -> str:
    """The prompt's greedy reply with nothing cached: a namespace of its own shares nothing."""
    endpoint, text = PROMPTS[prompt]
    namespace = f"cold-{prompt}"
    if endpoint == "chat":
        messages = [ChatMessage(role="user", content=text)]
        done = await rt.complete(
            model, messages=messages, max_tokens=max_tokens, namespace=namespace
        )
    else:
        done = await rt.complete(model, text, max_tokens=max_tokens, namespace=namespace)
    if not isinstance(done.terminal, Finished):
        raise RuntimeError(f"the cold reply to prompt {prompt} did not finish: {done.terminal!r}")
    return done.text


async def _reset(rt: Runtime, model: str) -> None:
    """Drop every cached prefix of ``model`` and wait until the KV budget holds nothing."""
    await rt.reset(model)
    await wait_until(rt, lambda: rt.stats().actors["kv"].gauges["reserved"] == 0, what="KV 0")


def _active_memory(mx: Any) -> int:
    gc.collect()  # arrays in reference cycles are freed only by a collection
    mx.synchronize()
    return int(mx.get_active_memory())


def _quiescent(rt: Runtime) -> bool:
    actors = rt.stats().actors
    engines_idle = all(
        s.gauges["sequences"] == 0 and s.gauges["batch_size"] == 0
        for a, s in actors.items()
        if a.startswith("engine:")
    )
    return (
        engines_idle
        and actors["router"].gauges["live_requests"] == 0
        and actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]
    )


async def _client(
    client: httpx.AsyncClient, rt: Runtime, model: str, max_tokens: int, pending: Any
) -> None:
    for outcome in pending:
        endpoint, text = PROMPTS[outcome.prompt]
        body: dict[str, Any] = {"model": model, "temperature": 0, "stream": outcome.stream}
        if endpoint == "chat":
            body.update(
                messages=[{"role": "user", "content": text}], max_completion_tokens=max_tokens
            )
            path = "/v1/chat/completions"
        else:
            body.update(prompt=text, max_tokens=max_tokens)
            path = "/v1/completions"
        if outcome.stream:
            await _streamed(client, path, body, outcome)
        elif outcome.disconnect:
            await _left_unanswered(client, rt, path, body, outcome)
        else:
            response = await client.post(path, json=body)
            outcome.status = response.status_code
            if response.status_code == 200:
                choice = response.json()["choices"][0]
                outcome.text = (
                    choice["message"]["content"] if endpoint == "chat" else choice["text"]
                )
                outcome.finish_reason = choice["finish_reason"]


async def _left_unanswered(
    client: httpx.AsyncClient, rt: Runtime, path: str, body: dict[str, Any], outcome: HttpOutcome
) -> None:
    """Send a non-streamed request and go away (close the connection) as soon as the engine has
    done more work after it was sent: queued, prefilling or decoding, whichever it was by then."""
    work = _engine_work(rt)
    async with anyio.create_task_group() as tg:

        async def leave_on_progress() -> None:
            await wait_until(rt, lambda: _engine_work(rt) > work, timeout=120, what="engine work")
            tg.cancel_scope.cancel()

        tg.start_soon(leave_on_progress)
        response = await client.post(path, json=body)
        outcome.status = response.status_code  # answered before the engine's next chunk or step
        tg.cancel_scope.cancel()


def _engine_work(rt: Runtime) -> int:
    return sum(
        s.counters.get("prefilled_tokens", 0) + s.counters.get("decoded_tokens", 0)
        for a, s in rt.stats().actors.items()
        if a.startswith("engine:")
    )


async def _streamed(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], outcome: HttpOutcome
) -> None:
    async with client.stream("POST", path, json=body) as response:
        outcome.status = response.status_code
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if outcome.disconnect:
                return  # leaving the block closes the connection mid-stream
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            outcome.text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason


@contextlib.asynccontextmanager
async def serve_on_loopback(
    server: OpenAIServer,
    *,
    start_within_s: float = 120.0,
    client_timeout: float | httpx.Timeout = 120.0,
) -> AsyncIterator[httpx.AsyncClient]:
    """uvicorn serving the app on an ephemeral loopback port, and a client for it."""
    config = uvicorn.Config(
        server.app, lifespan="on", ws="none", log_config=None, log_level="warning"
    )
    uvicorn_server = uvicorn.Server(config)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(uvicorn_server.serve, [listener])
            with anyio.fail_after(start_within_s):  # uvicorn sets a flag, nothing to wait on
                while not uvicorn_server.started:
                    await anyio.lowlevel.checkpoint()
            try:
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=client_timeout
                ) as client:
                    yield client
            finally:
                uvicorn_server.should_exit = True
