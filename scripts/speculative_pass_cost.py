"""What a B=1 verification pass of n tokens costs against a one-token pass: the curve behind
``drafting.PASS_COST`` (docs/design.md, "Speculative decoding (prompt lookup)").

For n = 1..``--widths``, the median (of ``--reps``) time of one forward pass of n tokens over a
cache holding a ``--prompt``-token prompt, cut back after each pass (as ``Backend.rewind`` does),
each width timed in turn per rep so that a busy moment slows them alike. Prints each n's median in
ms and as a multiple of n = 1 (and the best rep's, a check on a busy machine), then the
least-squares ``c`` of ``1 + c * log2(n)`` through them.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 PYTHONPATH=. \
        python scripts/speculative_pass_cost.py [--widths 12] [--reps 9] smollm2 gemma3
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from bench.models import load_bench_model


def pass_times(model: Any, prompt: int, widths: int, reps: int) -> dict[int, list[float]]:
    """Seconds of each rep's n-token pass for each n in 1..``widths``."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[(7 * i) % 1000 + 10 for i in range(prompt)]]), cache=cache))
    times: dict[int, list[float]] = {n: [] for n in range(1, widths + 1)}
    for rep in range(reps + 1):  # the first round warms up and is dropped
        for n in times:
            step = mx.array([[11 + i for i in range(n)]])
            start = time.perf_counter()
            mx.eval(model(step, cache=cache))
            elapsed = time.perf_counter() - start
            for c in cache:
                c.trim(n)
            if rep:
                times[n].append(elapsed)
    return times


def log_fit(ratios: dict[int, float]) -> float:
    """The least-squares ``c`` of ``ratio = 1 + c * log2(n)``."""
    xs = [(math.log2(n), r - 1.0) for n, r in ratios.items() if n > 1]
    return sum(x * y for x, y in xs) / sum(x * x for x, _ in xs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["smollm2", "gemma3"])
    parser.add_argument("--widths", type=int, default=12)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--prompt", type=int, default=300)
    args = parser.parse_args()
    for name in args.models:
        model = load_bench_model(name).model
        runs = pass_times(model, args.prompt, args.widths, args.reps)
        times = {n: statistics.median(ts) for n, ts in runs.items()}
        ratios = {n: t / times[1] for n, t in times.items()}
        best = {n: min(ts) / min(runs[1]) for n, ts in runs.items()}  # a check on the medians
        c = log_fit(ratios)
        print(f"{name}: n-token pass, median of {args.reps} after a {args.prompt}-token prompt")
        for n, t in times.items():
            fit = 1 + c * math.log2(n)
            print(
                f"  n={n:2}: {t * 1e3:7.2f} ms  {ratios[n]:5.2f}x  (fit {fit:5.2f}x, "
                f"best of {args.reps} {best[n]:5.2f}x)"
            )
        print(f"  fit: 1 + {c:.3f} * log2(n)")


if __name__ == "__main__":
    main()
