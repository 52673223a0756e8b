"""Where the runtime on llama.cpp spends time per decoded token, above ``llama_decode`` (issue 22).

Greedy decode of the same ~100-token prompt through each layer, the layers in turns (a round runs
each once, back to back, so they share that moment's load on a shared CPU), in one process:

- ``raw``: ``binding.Context.decode`` of one row (alone, as llama-server decodes it; with
  ``exact_reuse`` beside a throwaway row, as the backend then does) and numpy's argmax, in a loop:
  the floor;
- ``feed``: ``LlamaCppBackend.feed`` and an MLX argmax of the array it returns;
- ``runtime``: the in-process ``Runtime`` (``rt.generate``), from its first token to its last;
- ``http``: ``mlxrt serve --backend llamacpp``, streaming ``/v1/completions`` (``--http``; its
  CPU time is the server process's).

Each layer's tok/s, the median of its per-round ratios to ``raw``, and the CPU time it spends per
token (all threads: the ratio moves with the load, CPU time much less). With ``--batch 4,8``
also that many streams decoded together: ``raw`` one ``llama_decode`` of B rows, ``batch``
``LlamaDecodeBatch.step``, ``runtime`` B concurrent requests (aggregate tok/s). The B=1 layers
must give the same tokens (checked). ``--only-runtime N`` just runs the runtime, for a profiler;
``--loop-cpu B`` only measures the event loop's CPU per token while B streams decode. Not a test.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 PYTHONPATH=. \\
        .venv/bin/python scripts/llamacpp_overhead.py --rounds 5 [--batch 4,8] [--http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import anyio
import mlx.core as mx
import numpy as np

from bench.prompts import make_text
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.backends.llamacpp.passes import Row
from runtime.backends.options import LlamaCppOptions
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, TokensEmitted

GGUF = Path.home() / ".cache/mlx-actor-runtime/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"


class Rate(NamedTuple):
    tok_s: float
    cpu_ms: float  # process CPU time per token, every thread


class Clock:
    """Wall and process CPU time from ``start`` to ``stop``, per token."""

    def start(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rate(self, tokens: int) -> Rate:
        wall = time.perf_counter() - self.wall
        return Rate(tokens / wall, 1000 * (time.process_time() - self.cpu) / tokens)


# ---------------------------------------------------------------------- B=1


def raw_loop(backend: LlamaCppBackend, prompt: list[int], n: int) -> tuple[Rate, list[int]]:
    """The floor: one ``llama_decode`` per token as the backend makes it (the row alone, as
    llama-server decodes it, unless the model has ``exact_reuse``) and a numpy argmax."""
    state = backend.new_state()
    backend.prefill(state, prompt)
    ctx = backend.context
    seq = backend.pool.resident(state)
    token = int(np.argmax(np.asarray(backend.logits(state))))
    out, pos, clock = [token], len(prompt), Clock()
    clock.start()
    for _ in range(n - 1):
        (logits,) = ctx.decode([Row(seq, pos, token, True)])
        token = int(np.argmax(logits))
        out.append(token)
        pos += 1
    return clock.rate(n - 1), out


def feed_loop(backend: LlamaCppBackend, prompt: list[int], n: int) -> tuple[Rate, list[int]]:
    """``LlamaCppBackend.feed`` and an MLX argmax per token."""
    state = backend.new_state()
    backend.prefill(state, prompt)
    token = mx.argmax(backend.logits(state))
    out, clock = [int(token.item())], Clock()
    clock.start()
    for _ in range(n - 1):
        token = mx.argmax(backend.feed(state, token))
        out.append(int(token.item()))
    return clock.rate(n - 1), out


async def runtime_streams(rt: Runtime, prompts: list[list[int]], n: int) -> tuple[Rate, list[int]]:
    """``len(prompts)`` concurrent requests, timed while all of them decode: from the last first
    token to the first last one (so streams still joining or already done do not count); the
    first request's tokens."""
    events: list[list[tuple[float, float, int]]] = [[] for _ in prompts]  # wall, cpu, tokens
    outputs: list[list[int]] = [[] for _ in prompts]

    async def one(index: int) -> None:
        async with rt.generate("m", prompt_tokens=prompts[index], max_tokens=n) as stream:
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    now = (time.perf_counter(), time.process_time(), len(event.token_ids))
                    events[index].append(now)
                    outputs[index] += event.token_ids

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(one, index)
    start = max(e[0] for e in events)
    end = min(e[-1] for e in events)
    tokens = sum(k for stream in events for t, _, k in stream if start[0] < t <= end[0])
    wall, cpu = end[0] - start[0], end[1] - start[1]
    return Rate(tokens / wall, 1000 * cpu / tokens), outputs[0]


# ---------------------------------------------------------------------- B>1


def raw_batch(backend: LlamaCppBackend, prompts: list[list[int]], n: int) -> Rate:
    """One ``llama_decode`` of one row per stream and a numpy argmax per row, per step."""
    ctx, pool = backend.context, backend.pool
    states = [backend.new_state() for _ in prompts]
    seqs: list[int] = []
    for state, prompt in zip(states, prompts, strict=True):
        backend.prefill(state, prompt)
        seqs.append(pool.resident(state, keep=tuple(seqs)))
    tokens = [int(np.argmax(np.asarray(backend.logits(s)))) for s in states]
    pos, clock = [len(p) for p in prompts], Clock()
    clock.start()
    for _ in range(n - 1):
        rows = [Row(s, p, t, True) for s, p, t in zip(seqs, pos, tokens, strict=True)]
        tokens = [int(np.argmax(row)) for row in ctx.decode(rows)]
        pos = [p + 1 for p in pos]
    return clock.rate(len(prompts) * (n - 1))


def handle_batch(backend: LlamaCppBackend, prompts: list[list[int]], n: int) -> Rate:
    """``LlamaDecodeBatch.step`` and an MLX argmax per member."""
    batch = backend.open_batch()
    assert batch is not None
    slots = []
    for prompt in prompts:
        state = backend.new_state()
        backend.prefill(state, prompt)
        slots.append(batch.join(state))
    fed: dict[int, int | mx.array] = {slot: 0 for slot in slots}  # any token: only a rate
    clock = Clock()
    clock.start()
    for _ in range(n - 1):
        logits = batch.step(fed)
        fed = {slot: int(mx.argmax(row).item()) for slot, row in logits.items()}  # type: ignore[misc]
    rate = clock.rate(len(prompts) * (n - 1))
    for slot in slots:
        batch.leave(slot)
    return rate


# ---------------------------------------------------------------------- HTTP


class Server:
    """``mlxrt serve --backend llamacpp`` on ``gguf``, as a child process."""

    def __init__(self, gguf: str, threads: int, max_batch: int) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        command = [sys.executable, "-m", "runtime.cli", "serve", "--backend", "llamacpp"]
        command += ["--model", f"m={gguf}", "--port", str(self.port), "--quiet"]
        command += ["--model-option", f"n_threads={threads}"]
        if max_batch:
            command += ["--model-option", f"max_batch={max_batch}"]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL)

    def cpu_s(self) -> float:
        """The server's CPU seconds so far (Linux: /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks

    async def ready(self) -> None:
        for _ in range(600):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit("mlxrt serve exited") from None
                await asyncio.sleep(0.5)
        raise SystemExit("mlxrt serve did not start")

    async def stream(self, prompt: list[int], n: int) -> tuple[Rate, int]:
        """One streaming completion: its tok/s from the first chunk to the last; its chunks."""
        body = json.dumps(
            {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
        ).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        chunks, wall, cpu = 0, 0.0, 0.0
        async for line in reader:
            if line.startswith(b"data: {"):
                chunks += 1
                if chunks == 1:
                    wall, cpu = time.perf_counter(), self.cpu_s()
        tokens = n - 1  # every chunk after the first; a chunk may carry several tokens
        rate = Rate(tokens / (time.perf_counter() - wall), 1000 * (self.cpu_s() - cpu) / tokens)
        writer.close()
        return rate, chunks

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


# ---------------------------------------------------------------------- driver


def _report(title: str, rates: dict[str, list[Rate]]) -> None:
    """Each layer's median tok/s, the median of its per-round ratios to the first layer, and its
    median CPU ms per token."""
    floor = next(iter(rates.values()))
    print(f"{title}:")
    for name, values in rates.items():
        ratios = [v.tok_s / f.tok_s for v, f in zip(values, floor, strict=True)]
        spread = ", ".join(f"{v.tok_s:.1f}" for v in values)
        print(
            f"  {name:8s} {statistics.median(v.tok_s for v in values):7.1f} tok/s  "
            f"{statistics.median(ratios):5.3f}x  "
            f"cpu {statistics.median(v.cpu_ms for v in values):6.2f} ms/tok   ({spread})"
        )


async def _rounds(
    layers: dict[str, Callable[[], Awaitable[Rate]]], n: int
) -> dict[str, list[Rate]]:
    rates: dict[str, list[Rate]] = {name: [] for name in layers}
    for _ in range(n):
        for name, layer in layers.items():
            rates[name].append(await layer())
    return rates


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--gguf", default=str(GGUF))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", default="", help="comma-separated batch sizes, e.g. 4,8")
    parser.add_argument("--http", action="store_true", help="also time mlxrt serve over HTTP")
    parser.add_argument("--only-runtime", type=int, default=0, help="run the runtime B=1 only")
    parser.add_argument("--uvloop", action="store_true", help="the in-process layers on uvloop")
    parser.add_argument(
        "--loop-cpu",
        type=int,
        default=0,
        metavar="B",
        help="only the event loop's CPU per token while B streams decode in process (the loop's "
        "thread time, which a loaded machine moves far less than wall time)",
    )
    return parser.parse_args()


async def main(args: argparse.Namespace) -> None:
    sizes = [int(b) for b in args.batch.split(",") if b]
    max_batch = max(sizes, default=0)
    extra = {"max_batch": max_batch} if max_batch else {}
    options: dict[str, str | int | float | bool | None] = {"n_threads": args.threads, **extra}
    spec = ModelSpec(name="m", path=args.gguf, backend="llamacpp", options=options)
    backend = LlamaCppBackend.load(spec, LlamaCppOptions(n_threads=args.threads, **extra))
    tokenizer = backend.chat_tokenizer
    prompts = [backend.encode(make_text(tokenizer, 100, seed=s)) for s in range(max_batch or 1)]
    server = Server(args.gguf, args.threads, max_batch) if args.http else None
    try:
        async with Runtime(RuntimeConfig()) as rt:
            await rt.load_model(spec)
            _, ours = await runtime_streams(rt, prompts[:1], args.tokens)  # warm-up, reference
            n = len(ours)
            if args.loop_cpu:
                group = [backend.encode(make_text(tokenizer, 64, seed=s)) for s in range(args.loop_cpu)]
                await runtime_streams(rt, group, 8)  # warm-up
                per_token = []
                for _ in range(args.rounds):
                    began = time.thread_time()  # the loop runs on this thread
                    await runtime_streams(rt, group, 64)
                    per_token.append(1000 * (time.thread_time() - began) / (64 * len(group)))
                print(f"loop CPU per token, {args.loop_cpu} streams: "
                      f"{statistics.median(per_token):.3f} ms ({per_token})")  # fmt: skip
                return
            if args.only_runtime:
                for _ in range(args.only_runtime):
                    await runtime_streams(rt, prompts[:1], n)
                return
            _, raw = raw_loop(backend, prompts[0], n)
            _, fed = feed_loop(backend, prompts[0], n)
            if not ours == raw == fed:
                raise SystemExit(f"the layers disagree:\nraw {raw}\nfeed {fed}\nruntime {ours}")
            print(f"{n} tokens after a {len(prompts[0])}-token prompt, {args.threads} thread(s)")

            async def raw_() -> Rate:
                return raw_loop(backend, prompts[0], n)[0]

            async def feed_() -> Rate:
                return feed_loop(backend, prompts[0], n)[0]

            async def runtime_() -> Rate:
                return (await runtime_streams(rt, prompts[:1], n))[0]

            layers = {"raw": raw_, "feed": feed_, "runtime": runtime_}
            if server is not None:
                await server.ready()
                await server.stream(prompts[0], n)  # warm-up: the prompt's prefix is cached

                async def http_() -> Rate:
                    assert server is not None
                    return (await server.stream(prompts[0], n))[0]

                layers["http"] = http_
            _report("B=1", await _rounds(layers, args.rounds))
            for size in sizes:
                group = prompts[:size]

                async def raw_b(group: list[list[int]] = group) -> Rate:
                    return raw_batch(backend, group, n)

                async def batch_b(group: list[list[int]] = group) -> Rate:
                    return handle_batch(backend, group, n)

                async def runtime_b(group: list[list[int]] = group) -> Rate:
                    return (await runtime_streams(rt, group, n))[0]

                await runtime_b()  # warm-up: the prompts' prefixes are cached
                layers = {"raw": raw_b, "batch": batch_b, "runtime": runtime_b}
                _report(f"B={size}", await _rounds(layers, args.rounds))
    finally:
        if server is not None:
            server.close()


if __name__ == "__main__":
    arguments = _arguments()
    anyio.run(main, arguments, backend_options={"use_uvloop": arguments.uvloop})
