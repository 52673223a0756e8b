"""Where a batched decode step of B streams on llama.cpp spends its time (issue 22).

B concurrent greedy streams through the in-process ``Runtime``, with every ``llama_decode`` of the
batch timed on the compute thread (wall, from a wrapper around ``Context._decode_call``). A step's
period is the time from one batch ``llama_decode``'s start to the next one's; the rest of the period
after ``llama_decode`` returns is the host's: logits, sampling, stop checks, detokenization, the
job's hand-back to the event loop and the next job's start. The same functions are timed one by
one (``--parts``) to split that rest. The floor is a bare loop in the same process: one
``llama_decode`` of B rows through ``binding.Context`` and numpy's argmax over each row read in
place. Rounds alternate the two, so they share the machine's load.

    PYTHONPATH=. .venv/bin/python scripts/llamacpp_step_split.py --model gemma3-270m [--parts]

Prints per step (medians over rounds): the period, ``llama_decode``'s share, the host rest, and the
event loop's thread CPU per step. Not a test.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import anyio
import numpy as np

from bench.prompts import make_text
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.backends.llamacpp.binding import Context
from runtime.backends.llamacpp.passes import Row
from runtime.backends.options import LlamaCppOptions
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, TokensEmitted

# (wall start, wall end, compute thread CPU at start, at end, rows) of each llama_decode
Spans = list[tuple[float, float, float, float, int]]


def time_decode_calls(spans: Spans) -> None:
    """Record every ``Context._decode_call`` (start, end, rows) into ``spans``."""
    original = Context._decode_call

    def timed(self: Context, rows: Any, stop: Any) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            original(self, rows, stop)
        finally:
            spans.append((start, time.perf_counter(), cpu, time.thread_time(), len(rows)))

    Context._decode_call = timed  # type: ignore[method-assign]


def time_parts(totals: dict[str, list[float]]) -> None:
    """Accumulate the compute thread's CPU time in the host functions a step calls, by name."""
    import actors.engine.decode as decode_module
    from runtime.text.detokenizer import IncrementalDetokenizer
    from runtime.text.sampling import TokenSampler

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                totals.setdefault(label, []).append(time.thread_time() - start)

        setattr(owner, name, timed)

    wrap(Context, "_logits", "logits copy")
    wrap(TokenSampler, "draw", "sampler.draw")
    wrap(IncrementalDetokenizer, "add", "detokenize")
    wrap(decode_module, "read", "read (incl. detokenize)")


def time_jobs(jobs: list[tuple[float, float]]) -> None:
    """Record every batch job's (start, end) on the compute thread: between two, the compute
    thread waits for the event loop to take the last job's tokens and plan the next."""
    import actors.engine.compute as compute_module

    original = compute_module.run_batch

    def timed(*args: Any) -> None:
        start = time.perf_counter()
        try:
            original(*args)
        finally:
            jobs.append((start, time.perf_counter()))

    compute_module.run_batch = timed  # type: ignore[assignment]


async def streams(rt: Runtime, prompts: list[list[int]], n: int) -> tuple[float, float, float]:
    """B concurrent requests; the window (wall) in which all B decode, and the loop thread's CPU
    seconds over the whole run."""
    first: list[float] = []
    last: list[float] = []
    outputs: list[list[int]] = [[] for _ in prompts]
    began = time.thread_time()

    async def one(index: int) -> None:
        async with rt.generate("m", prompt_tokens=prompts[index], max_tokens=n) as stream:
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    if not outputs[index]:
                        first.append(time.perf_counter())
                    outputs[index] += event.token_ids
        last.append(time.perf_counter())

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(one, index)
    return max(first), min(last), time.thread_time() - began


def bare_floor(backend: LlamaCppBackend, prompts: list[list[int]], n: int) -> list[float]:
    """One ``llama_decode`` of B rows and numpy's argmax over each row in place, per step; each
    step's period."""
    ctx, pool = backend.context, backend.pool
    states = [backend.new_state() for _ in prompts]
    seqs: list[int] = []
    for state, prompt in zip(states, prompts, strict=True):
        backend.prefill(state, prompt, logits=False)
        seqs.append(pool.resident(state, keep=tuple(seqs)))
    lib, raw = ctx._lib, ctx._ctx
    tokens, pos = [0] * len(prompts), [len(p) for p in prompts]
    periods, last = [], time.perf_counter()
    for _ in range(n):
        ctx._decode_call(
            [Row(s, p, t, True) for s, p, t in zip(seqs, pos, tokens, strict=True)], None
        )
        tokens = [
            int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(raw, i), (ctx.n_vocab,))))
            for i in range(len(prompts))
        ]
        pos = [p + 1 for p in pos]
        now = time.perf_counter()
        periods.append(now - last)
        last = now
    return periods[1:]  # the states' seq_ids go back to the pool once they are dropped


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def main(args: argparse.Namespace) -> None:
    spans: Spans = []
    totals: dict[str, list[float]] = {}
    jobs: list[tuple[float, float]] = []
    time_decode_calls(spans)
    time_jobs(jobs)
    if args.parts:
        time_parts(totals)
    opts = {"n_threads": args.threads, "max_batch": max(args.streams, 4)}
    spec = ModelSpec(name="m", path=args.model, backend="llamacpp", options=opts)
    floor_backend = LlamaCppBackend.load(spec, LlamaCppOptions(**opts))  # type: ignore[arg-type]
    tok = floor_backend.chat_tokenizer
    prompts = [floor_backend.encode(make_text(tok, 100, seed=s)) for s in range(args.streams)]
    rows: dict[str, list[float]] = {
        "period": [],
        "decode": [],
        "host": [],
        "host_cpu": [],
        "loop_cpu": [],
        "hop": [],
        "hop_per_step": [],
    }
    floor: list[float] = []
    async with Runtime(RuntimeConfig()) as rt:
        await rt.load_model(spec)
        await streams(rt, prompts, 16)  # warm-up: the prompts' prefixes are cached
        for _ in range(args.rounds):
            spans.clear()
            jobs.clear()
            for values in totals.values():
                values.clear()
            start, end, loop_cpu = await streams(rt, prompts, args.tokens)
            steps = [s for s in spans if s[4] == args.streams and start < s[0] and s[1] < end]
            pairs = list(itertools.pairwise(steps))
            rows["period"].append(_median([b[0] - a[0] for a, b in pairs]))
            rows["decode"].append(_median([a[1] - a[0] for a, _ in pairs]))
            rows["host"].append(_median([b[0] - a[1] for a, b in pairs]))
            rows["host_cpu"].append(_median([b[2] - a[3] for a, b in pairs]))
            rows["loop_cpu"].append(loop_cpu / max(1, len(spans)))
            inside = [j for j in jobs if start < j[0] and j[1] < end]
            hops = [b[0] - a[1] for a, b in itertools.pairwise(inside)]
            rows["hop"].append(_median(hops))
            rows["hop_per_step"].append(sum(hops) / max(1, len(pairs)))
            floor.append(_median(bare_floor(floor_backend, prompts, args.tokens)))
            if args.parts and totals:
                n_steps = max(1, sum(s[4] == args.streams for s in spans))
                print("  parts per batch step (ms):", {
                    k: round(1000 * sum(v) / n_steps, 3) for k, v in totals.items()
                })  # fmt: skip
    floor_backend.close()
    ms = {k: 1000 * _median(v) for k, v in rows.items()}
    f = 1000 * _median(floor)
    print(
        f"{args.model}, {args.streams} streams, {args.threads} threads: step period "
        f"{ms['period']:.2f} ms (llama_decode {ms['decode']:.2f}, host rest {ms['host']:.3f} wall, "
        f"{ms['host_cpu']:.3f} compute thread CPU), "
        f"loop CPU {ms['loop_cpu']:.3f} ms per llama_decode; bare floor {f:.2f} ms "
        f"(runtime/floor {ms['period'] / f:.3f}x); between batch jobs the compute thread waits "
        f"{ms['hop']:.3f} ms (median), {ms['hop_per_step']:.3f} ms per step"
    )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", action="store_true", help="also time the host functions")
    return parser.parse_args()


if __name__ == "__main__":
    anyio.run(main, _arguments())
