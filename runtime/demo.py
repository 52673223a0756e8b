"""``make run``: the runtime's behaviours shown on what exists today, saying plainly what runs.

No trained default model exists yet. Part 1 runs on the simulated backend (deterministic fake
model, real actors and threads); part 2 runs the tiny random-weight MLX models built offline
(full attention, sliding window, hybrid recurrent); part 3 serves one of them over the
OpenAI-compatible HTTP API and streams a chat completion from it. Random weights produce gibberish
text: the point is the runtime's behaviour (reuse, prewarm, cancellation, batching, streaming,
teardown), not the words.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time

import anyio

from runtime.actor import release_thread_resources
from runtime.api import Runtime
from runtime.config import RuntimeConfig
from runtime.messages import ModelSpec, Started, TokensEmitted


def _say(text: str) -> None:
    print(text, flush=True)


async def _tour(rt: Runtime, model: str, slow_prompt: str) -> None:
    turn1 = await rt.complete(model, "You are terse. User: hello", max_tokens=12)
    _say(f"  turn 1: {turn1.text!r}  ({turn1.terminal.usage.prompt_tokens} prompt tokens, "
         f"path {turn1.started.path if turn1.started else '?'})")  # fmt: skip
    prompt2 = "You are terse. User: hello" + turn1.text + " User: and again"
    turn2 = await rt.complete(model, prompt2, max_tokens=12)
    started = turn2.started
    assert started is not None
    _say(f"  turn 2: reused {started.cached_tokens} of {started.prompt_tokens} prompt tokens "
         f"via path {started.path}")  # fmt: skip

    warm = await rt.prewarm(model, "A long system prompt the user is about to need.")
    hot = await rt.complete(model, "A long system prompt the user is about to need.", max_tokens=4)
    assert hot.started is not None
    _say(f"  prewarm: {type(warm).__name__}; the request after it reused "
         f"{hot.started.cached_tokens} tokens ({hot.started.path})")  # fmt: skip

    began = time.perf_counter()
    async with rt.generate(model, slow_prompt, max_tokens=8) as stream:
        async for event in stream:
            if isinstance(event, Started):
                break  # the user typed on: abandon the stale prefill
    quick = await rt.complete(model, "next keystroke", max_tokens=2)
    waited = time.perf_counter() - began
    _say(f"  cancel mid-prefill of a {len(slow_prompt)}-char prompt: the next request finished "
         f"{waited * 1000:.0f} ms later ({type(quick.terminal).__name__})")  # fmt: skip

    async with rt.generate(model, "Stream me some tokens:", max_tokens=16) as stream:
        events = [e async for e in stream if isinstance(e, TokensEmitted)]
    tokens = sum(len(e.token_ids) for e in events)
    text = "".join(e.text for e in events)
    _say(f"  streamed {tokens} tokens in {len(events)} coalesced events: {text!r}")

    engine = next(name for name in rt.stats().actors if name.startswith(f"engine:{model}#"))
    before = rt.stats().actors[engine].counters.get("batch_steps", 0)

    async def one(i: int) -> None:
        await rt.complete(model, f"Request {i} of four:", max_tokens=16)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    steps = rt.stats().actors[engine].counters.get("batch_steps", 0) - before
    _say(f"  4 concurrent requests: decoded together in {steps} batched steps")


async def _simulated() -> None:
    _say("== Part 1: simulated backend (deterministic fake model, real actors and threads) ==")
    spec = ModelSpec(
        name="sim",
        backend="simulated",
        prefill_chunk_tokens=64,
        options={"prefill_s_per_token": 0.0005, "decode_s_per_token": 0.002},
    )
    async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:
        loaded = await rt.load_model(spec)
        _say(f"  loaded {loaded.model!r}: reuse path {loaded.reuse_path}")
        await _tour(rt, "sim", "x" * 4000)
        unloaded = await rt.unload_model("sim")
        kv = rt.stats().actors["kv"]
        _say(f"  unloaded epoch {unloaded.epoch}; KV reserved now {kv.gauges.get('reserved')}")


async def _tiny_mlx() -> None:
    try:
        from runtime.mlx_backend import MlxBackend  # noqa: F401
        from runtime.testing.tiny_models import TINY_MODEL_KINDS, tiny_model_path
    except ImportError:
        _say("== Part 2 skipped: the MLX backend is not built yet (see the open issues) ==")
        return
    for kind in TINY_MODEL_KINDS:
        path = tiny_model_path(kind)
        _say(f"== Part 2: tiny random-weight MLX model {kind!r} ({path}) ==")
        async with Runtime(RuntimeConfig()) as rt:
            loaded = await rt.load_model(ModelSpec(name=kind, path=str(path), backend="mlx"))
            _say(f"  loaded: reuse path {loaded.reuse_path}, {loaded.bytes_per_token} B/token")
            await _tour(rt, kind, "lorem ipsum dolor " * 60)


async def _http() -> None:
    import uvicorn

    from runtime.server import OpenAIServer, ServerConfig
    from runtime.testing.tiny_models import tiny_model_path

    _say("== Part 3: the same runtime over the OpenAI-compatible HTTP API (mlxrt serve) ==")
    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    app = OpenAIServer(ServerConfig(models=(spec,))).app
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    # Listening before the server starts: a request sent while the model still loads waits in
    # the socket's backlog, so nothing has to poll for the server being up.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: server.serve(sockets=[listener]))
            body = {
                "model": "llama",
                "messages": [{"role": "user", "content": "Say hello."}],
                "max_tokens": 24,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            lines = await anyio.to_thread.run_sync(_post_sse, port, "/v1/chat/completions", body)
            chunks = [json.loads(line) for line in lines if line != "[DONE]"]
            text = "".join(
                c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]
            )
            usage = chunks[-1]["usage"]
            _say(f"  POST http://127.0.0.1:{port}/v1/chat/completions (stream): {len(chunks)} SSE "
                 f"chunks, {usage['completion_tokens']} tokens: {text!r}")  # fmt: skip
            server.should_exit = True


def _post_sse(port: int, path: str, body: dict[str, object]) -> list[str]:
    """The ``data:`` payloads of one streamed response (plain http.client: no extra dependency)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
    finally:
        connection.close()
    return [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    _say("mlx-actor-runtime demo. No trained default model exists yet: this shows the runtime on")
    _say("a simulated model, then on tiny random-weight MLX models (gibberish text by design),")
    _say("then serves one over HTTP.\n")
    anyio.run(_simulated, backend_options={"use_uvloop": True})
    anyio.run(_tiny_mlx, backend_options={"use_uvloop": True})
    anyio.run(_http, backend_options={"use_uvloop": True})
    release_thread_resources()  # building the tiny models ran MLX on this thread


if __name__ == "__main__":
    main()
