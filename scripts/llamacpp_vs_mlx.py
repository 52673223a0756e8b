"""The runtime on llama.cpp against the runtime on MLX, one model, the same GGUF file.

Measures, in one process and one model loaded at a time (each backend gets the CPU to itself):
single-stream decode tok/s, cold TTFT of a ~500-token prompt (a new prompt each round, so no cache
serves it), and the aggregate tok/s of 4 concurrent streams. Prints medians and the llama.cpp /
MLX ratios. Not a test (docs/models.md, "The llama.cpp backend").

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python scripts/llamacpp_vs_mlx.py smollm2-135m-instruct --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import anyio

from bench.prompts import make_text
from runtime.backends.llamacpp.tokenizer import load_tokenizer, tokenizer_dir
from runtime.backends.model_source import converted_models_dir
from runtime.backends.model_store import fetch_model
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, TokensEmitted

DECODE_TOKENS = 128


async def _ttft(rt: Runtime, name: str, prompt: str) -> float:
    start = time.perf_counter()
    async with rt.generate(name, prompt, max_tokens=1, namespace=f"ttft-{prompt[:12]}") as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted):
                return time.perf_counter() - start
    raise RuntimeError("the runtime emitted no token")


async def _decode_rate(rt: Runtime, name: str, prompt: str, streams: int) -> float:
    """Generated tokens per second over ``streams`` concurrent requests (the prompt's prefill
    excluded: timing starts at each stream's first token)."""
    firsts: list[float] = []
    counts: list[int] = []
    ends: list[float] = []

    async def one(index: int) -> None:
        n, first = 0, None
        async with rt.generate(name, f"{index}. {prompt}", max_tokens=DECODE_TOKENS) as stream:
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    first = first or time.perf_counter()
                    n += len(event.token_ids)
        assert first is not None
        firsts.append(first)
        counts.append(n - 1)
        ends.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for index in range(streams):
            tg.start_soon(one, index)
    return sum(counts) / (max(ends) - min(firsts))


async def measure(model: str, backend: str, rounds: int, threads: int) -> dict[str, float]:
    options: dict[str, str | int | float | bool | None] = {}
    if backend == "llamacpp" and threads:
        options["n_threads"] = threads
    spec = ModelSpec(name=model, path=model, backend=backend, options=options)
    tokenizer, _ = load_tokenizer(tokenizer_dir(fetch_model(model), converted_models_dir()))
    async with Runtime(RuntimeConfig()) as rt:
        await rt.load_model(spec)
        await _ttft(rt, model, make_text(tokenizer, 100, seed=999))  # warm-up
        prompts = [make_text(tokenizer, 500, seed=r) for r in range(rounds)]
        ttft = [await _ttft(rt, model, p) for p in prompts]
        short = "Once upon a time, in a lighthouse at the end of a long causeway,"
        one = [await _decode_rate(rt, model, short, 1) for _ in range(rounds)]
        four = [await _decode_rate(rt, model, short, 4) for _ in range(rounds)]
    return {
        "decode tok/s": statistics.median(one),
        "cold TTFT ~500 tokens (s)": statistics.median(ttft),
        "4 streams aggregate tok/s": statistics.median(four),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--llama-threads", type=int, default=0, help="llama.cpp threads (0: every CPU)"
    )
    args = parser.parse_args()
    results = {
        b: asyncio.run(measure(args.model, b, args.rounds, args.llama_threads))
        for b in ("llamacpp", "mlx")
    }
    for metric in results["mlx"]:
        llama, mlx = results["llamacpp"][metric], results["mlx"][metric]
        ratio = llama / mlx
        print(f"{metric:28s} llamacpp {llama:8.3f}  mlx {mlx:8.3f}  llamacpp/mlx {ratio:6.2f}x")


if __name__ == "__main__":
    main()
