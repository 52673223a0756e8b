"""What ``exact_reuse`` costs a llama.cpp decode step: B=1, 4 and 8 sequences, with and without
the throwaway rows (runtime/backends/llamacpp/passes.py), in one process, one after the other.

    python scripts/llamacpp_exact_cost.py [smollm2-135m-instruct|gemma3-270m] [--threads N]

Prints each median step time and the ratio padded / plain (timings on a shared machine are
noisy: compare the ratios of one run).
"""

from __future__ import annotations

import argparse
import statistics
import time

from runtime.backends.llamacpp.binding import Context
from runtime.backends.llamacpp.passes import Row
from runtime.backends.model_store import fetch_model

PREFIX = 200  # tokens each sequence holds before the timed steps
STEPS = 24


def step_ms(ctx: Context, batch: int, padded: bool) -> float:
    ctx.pads_lone_rows = padded
    for seq in range(batch):
        ctx.seq_rm(seq, 0, -1)
        ctx.decode([Row(seq, p, 100 + p % 50, False) for p in range(PREFIX)])
    times = []
    for step in range(STEPS):
        rows = [Row(seq, PREFIX + step, 7, True) for seq in range(batch)]
        start = time.perf_counter()
        ctx.decode(rows)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ctx = Context(
        fetch_model(args.model),
        context_length=1024,
        n_batch=512,
        n_seq_max=8,
        n_threads=args.threads,
    )
    try:
        if not ctx.lone_rows_differ():
            print("this build has no llamafile kernels: exact_reuse adds no rows here")
        for batch in (1, 4, 8):
            plain, padded = step_ms(ctx, batch, False), step_ms(ctx, batch, True)
            print(f"B={batch}: plain {plain:.1f} ms, padded {padded:.1f} ms, {padded / plain:.2f}x")
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
