"""Cold TTFT of one model dir: the embedded runtime vs mlx_lm.stream_generate vs mlx_lm.server.

The systems take turns, one request each per round, so CPU noise lands on all of them alike; each
round uses a new prompt of the same size (no system's cache can serve it). Prints the median per
system and the runtime's ratios to the others. Not a test (docs/performance.md).

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/cold_ttft.py DIR --tokens 500 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.http_client import Server, complete
from bench.prompts import make_text
from bench.serving import mlx_lm_server, running
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, TokensEmitted


async def _runtime_ttft(rt: Runtime, name: str, prompt: str) -> float:
    await rt.reset(name)
    start = time.perf_counter()
    async with rt.generate(name, prompt, max_tokens=1) as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted):
                return time.perf_counter() - start
    raise RuntimeError("the runtime emitted no token")


def _stream_generate_ttft(model: Any, tokenizer: Any, prompt: str) -> float:
    from mlx_lm import stream_generate

    start = time.perf_counter()
    for _ in stream_generate(model, tokenizer, prompt, max_tokens=1):
        return time.perf_counter() - start
    raise RuntimeError("stream_generate yielded nothing")


async def _main(args: argparse.Namespace, path: Path, server: Server | None) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(path))
    systems = set(args.systems.split(","))
    options: dict[str, str | int | float | bool | None] = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    spec = ModelSpec(name="m", path=str(path), options=options, prefill_chunk_tokens=args.chunk)
    times: dict[str, list[float]] = {s: [] for s in ("runtime", "stream_generate", "server")}
    async with Runtime(RuntimeConfig(kv_budget_bytes=2 << 30)) as rt:
        await rt.load_model(spec)
        warm = make_text(tokenizer, 16, 99)
        await _runtime_ttft(rt, "m", warm)
        _stream_generate_ttft(model, tokenizer, warm)
        if server is not None:
            await complete(server, warm, 1)
        for round_ in range(args.rounds):
            prompt = make_text(tokenizer, args.tokens, 1000 + round_)
            runs: list[tuple[str, Callable[[str], Any]]] = [
                ("runtime", lambda text: _runtime_ttft(rt, "m", text)),
                ("stream_generate", lambda text: _stream_generate_ttft(model, tokenizer, text)),
            ]
            if server is not None:
                runs.append(("server", lambda text: _server_ttft(server, text)))
            for system, run in runs if round_ % 2 == 0 else runs[::-1]:
                if system not in systems:
                    continue
                result = run(prompt)
                ttft = await result if asyncio.iscoroutine(result) else result
                times[system].append(ttft)
                print(f"round {round_} {system}: {ttft:.3f}s", flush=True)
    medians = {s: statistics.median(t) for s, t in times.items() if t}
    for system, value in medians.items():
        print(f"{system}: median cold TTFT {value:.3f}s over {len(times[system])} rounds")
    for system, value in medians.items():
        if system != "runtime" and "runtime" in medians:
            print(f"runtime/{system}: {medians['runtime'] / value:.2f}x")


async def _server_ttft(server: Server, prompt: str) -> float:
    return (await complete(server, prompt, 1)).ttft


def main(args: argparse.Namespace) -> None:
    path = Path(args.model).expanduser()
    # The server starts first, outside the event loop: ``running`` polls it with asyncio.run.
    if "server" not in args.systems.split(","):
        asyncio.run(_main(args, path, None))
        return
    with running([mlx_lm_server(path)]) as [server]:
        asyncio.run(_main(args, path, server))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", help="an mlx-lm model directory")
    parser.add_argument("--tokens", type=int, default=500, help="prompt size in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=256, help="ModelSpec.prefill_chunk_tokens")
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE model option")
    parser.add_argument("--systems", default="runtime,stream_generate,server")
    main(parser.parse_args())
