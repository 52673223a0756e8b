"""What scattered seq_ids cost a batched prefill (``prefill_together``) on llama.cpp: one
``llama_decode`` of 4 prompts on ids 0-3 against 0,2,4,6 (``split_equal`` makes one pass only of
consecutive ids, seqs.py), with equal prompt lengths and with unequal ones (rows in increasing
id order: llama.cpp's equal sub-passes; decreasing: one pass per prompt, as ``prefill_together``
sends unequal rests).

    python scripts/llamacpp_together_split.py [smollm2-135m-instruct|gemma3-270m] [--threads N]

Prints each layout's median time; compare the ratios of one run (a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import statistics
import time

from runtime.backends.llamacpp.binding import Context
from runtime.backends.llamacpp.passes import Row
from runtime.backends.model_store import fetch_model

REPS = 7


def prefill_ms(ctx: Context, name: str, layout: dict[int, int]) -> float:
    """Median time of one call prefilling ``layout`` (seq_id -> prompt length), rows in
    increasing id order (decreasing where the name says so)."""
    times = []
    for _ in range(REPS):
        for seq in range(8):
            ctx.seq_rm(seq, 0, -1)
        rows = [
            Row(seq, p, 100 + (p + seq) % 50, p == n - 1)
            for seq, n in sorted(layout.items(), reverse=name.endswith("decreasing"))
            for p in range(n)
        ]
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
        fetch_model(args.model), context_length=512, n_batch=512, n_seq_max=8,
        n_threads=args.threads,
    )  # fmt: skip
    layouts = {
        "equal 4x8, ids 0-3": {0: 8, 1: 8, 2: 8, 3: 8},
        "equal 4x8, ids 0,2,4,6": {0: 8, 2: 8, 4: 8, 6: 8},
        "equal 4x24, ids 0-3": {0: 24, 1: 24, 2: 24, 3: 24},
        "equal 4x24, ids 0,2,4,6": {0: 24, 2: 24, 4: 24, 6: 24},
        "equal 4x64, ids 0-3": {0: 64, 1: 64, 2: 64, 3: 64},
        "equal 4x64, ids 0,2,4,6": {0: 64, 2: 64, 4: 64, 6: 64},
        "96/80/64/48, ids 0-3": {0: 96, 1: 80, 2: 64, 3: 48},
        "96/80/64/48, ids 0,2,4,6": {0: 96, 2: 80, 4: 64, 6: 48},
        "96/80/64/48, ids 0-3 decreasing": {0: 96, 1: 80, 2: 64, 3: 48},
    }
    try:
        for name, layout in layouts.items():
            print(f"{name}: {prefill_ms(ctx, name, layout):.1f} ms")
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
