"""What a llama.cpp step's logits cost on their way to the samplers: one copy, from llama.cpp's
buffer straight into an ``mx.array`` (binding.py ``Context._logits``), against the two it took
before (into numpy, then numpy into MLX); timed alternately in one process and set against a
B=1 step and the rows of an 8-row step.

    python scripts/llamacpp_logits_copy.py [smollm2-135m-instruct|gemma3-270m] [--threads N]

Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

from runtime.backends.llamacpp.binding import Context
from runtime.backends.llamacpp.passes import Row
from runtime.backends.model_store import fetch_model

REPS = 200  # per block; blocks of the two ways alternate
BLOCKS = 10


def two_copies(ctx: Context, i: int) -> mx.array:
    """The path before: a numpy copy of llama.cpp's row, then MLX's copy of that."""
    ptr = ctx._lib.llama_get_logits_ith(ctx._ctx, i)
    return mx.array(np.ctypeslib.as_array(ptr, shape=(ctx.n_vocab,)).copy())


def per_call_us(fn: object, ctx: Context, i: int) -> float:
    start = time.perf_counter()
    for _ in range(REPS):
        fn(ctx, i)  # type: ignore[operator]
    return 1e6 * (time.perf_counter() - start) / REPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ctx = Context(
        fetch_model(args.model), context_length=512, n_batch=512, n_seq_max=8,
        n_threads=args.threads,
    )  # fmt: skip
    try:
        ctx.decode([Row(0, p, 100 + p % 50, False) for p in range(64)])
        steps = []
        for pos in range(64, 88):
            start = time.perf_counter()
            (kept,) = ctx.decode([Row(0, pos, 7, True)])
            steps.append(time.perf_counter() - start)
        assert np.array_equal(np.array(kept), np.array(two_copies(ctx, 0)))
        old, new = [], []
        for _ in range(BLOCKS):
            old.append(per_call_us(two_copies, ctx, 0))
            new.append(per_call_us(lambda c, i: c._logits(i), ctx, 0))
        old_us, new_us = statistics.median(old), statistics.median(new)
        step_us = 1e6 * statistics.median(steps)
        print(f"{args.model}: vocab {ctx.n_vocab}, B=1 step {step_us / 1000:.2f} ms")
        print(f"logits of a row: two copies {old_us:.1f} us, one copy {new_us:.1f} us "
              f"({new_us / old_us:.2f}x); saved per row {old_us - new_us:.1f} us = "
              f"{100 * (old_us - new_us) / step_us:.2f}% of a B=1 step")  # fmt: skip
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
