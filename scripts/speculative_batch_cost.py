"""What speculation inside a decode batch would gain: the measured trade behind design.md's "not
done" (speculative decoding, continuous batches).

A batch of B rows each verifying k drafts is one pass of B x (k + 1) tokens (mlx-lm's
``BatchKVCache``, rows of a 200-token prompt each). Against the plain batch step (B x 1 tokens,
one token per row), a speculative step yields E(k, a) = (1 - a^(k+1)) / (1 - a) tokens per row
for a per-draft acceptance rate a, so the gain is E(k, a) x t(B, 1) / t(B, k + 1). Prints the
pass times (best of ``REPS``) and the gain for a few rates; B = 1 is the fast path speculation
already runs on.

    python scripts/speculative_batch_cost.py [smollm2|gemma3]
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from bench.models import load_bench_model

PROMPT = 200
REPS = 5
ROWS = (1, 2, 4, 8)
WIDTHS = (1, 2, 3, 5)  # k + 1 for k = 0 (plain), 1, 2, 4 drafts
RATES = (0.5, 0.8, 0.95)


def pass_s(model: object, rows: int, width: int) -> float:
    """Best time of a (rows, width) pass over rows holding ``PROMPT`` tokens each."""
    caches = [BatchKVCache([0] * rows) for _ in model.layers]  # type: ignore[attr-defined]
    prompt = mx.array([[(7 * i + r) % 1000 + 10 for i in range(PROMPT)] for r in range(rows)])
    mx.eval(model(prompt, cache=caches))  # type: ignore[operator]
    step = mx.array([[11 + r + i for i in range(width)] for r in range(rows)])
    best = float("inf")
    for _ in range(REPS):
        start = time.perf_counter()
        mx.eval(model(step, cache=caches))  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
        for c in caches:
            c.trim(width)
    return best


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    model = load_bench_model(name).model
    print(f"{name}: pass ms by rows x tokens per row (best of {REPS}, {PROMPT}-token rows)")
    times = {(b, w): pass_s(model, b, w) for b in ROWS for w in WIDTHS}
    for b in ROWS:
        cells = "  ".join(f"{w}: {times[(b, w)] * 1e3:7.1f}" for w in WIDTHS)
        print(f"  B={b}  {cells}")
    print("gain of a speculative batch step over a plain one (tokens/s), by drafts k and rate a")
    for b in ROWS:
        for a in RATES:
            gains = []
            for w in WIDTHS[1:]:
                k = w - 1
                expected = (1 - a ** (k + 1)) / (1 - a)
                gains.append(f"k={k}: {expected * times[(b, 1)] / times[(b, w)]:4.2f}x")
            print(f"  B={b} a={a}: {'  '.join(gains)}")


if __name__ == "__main__":
    main()
