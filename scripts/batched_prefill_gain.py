"""What a batched prefill would save: one prompt's prefill alone vs its share of mlx-lm's batched
prefill of N prompts (``mlx_lm.generate.batch_generate``, as ``mlx_lm.server`` batches newcomers).

The runtime prefills concurrent newcomers one at a time (each goes ahead of the decode batch,
actors/engine/turns.py); this measures the per-prompt cost it leaves on the table. Not a test
(docs/performance.md).

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/batched_prefill_gain.py \
        --model smollm2-135m-instruct --tokens 64 --prompts 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics

from bench.prompts import make_text
from runtime.backends.model_source import prepare_model
from runtime.messages import ModelSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from mlx_lm import load
    from mlx_lm.generate import batch_generate

    model, tokenizer = load(str(prepare_model(ModelSpec(name="m", path=args.model)).path))
    alone: list[float] = []
    batched: list[float] = []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        seeds = range(1000 * round_, 1000 * round_ + args.prompts)
        prompts = [tokenizer.encode(make_text(tokenizer, args.tokens, s)) for s in seeds]
        one = [
            batch_generate(model, tokenizer, [p], max_tokens=1).stats.prompt_time for p in prompts
        ]
        many = batch_generate(model, tokenizer, prompts, max_tokens=1).stats.prompt_time
        if round_:
            alone.append(statistics.median(one))
            batched.append(many / len(prompts))
    a, b = statistics.median(alone) * 1000, statistics.median(batched) * 1000
    print(
        f"{args.model}: {args.tokens}-token prompt alone {a:.1f} ms; its share of a batched "
        f"prefill of {args.prompts}: {b:.1f} ms (batched/alone {b / a:.2f}x)"
    )


if __name__ == "__main__":
    main()
