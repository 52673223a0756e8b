"""``python -m bench.weights``: prefill and decode speed of the real models per weight format.

The evidence behind ``weights=auto`` (docs/models.md): each known model converted from its GGUF in
each format, run by raw mlx-lm (``generate_step``) on a ~500-token prompt then 64 greedy tokens,
median of ``--reps``. Prints one JSON object per measurement, then a table. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

FORMATS = ("float32", "bfloat16", "quantized")
MODELS = ("smollm2-135m-instruct", "gemma3-270m")
_TEXT = (
    "The history of the city begins with a small settlement on the river bank, where traders met "
    "to exchange grain, salt and cloth. Over the centuries the settlement grew into a market town. "
)


def _measure(path: str, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one cold request."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = _loaded(path, load)
    tokens = (tokenizer.encode(_TEXT * 40))[:prompt_tokens]
    cache = make_prompt_cache(model)
    began = time.perf_counter()
    first = None
    n = 0
    steps = generate_step(mx.array(tokens), model, max_tokens=decode_tokens, prompt_cache=cache)
    for _token, _ in steps:
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return len(tokens) / (first - began), (n - 1) / (end - first)


_CACHE: dict[str, Any] = {}


def _loaded(path: str, load: Any) -> Any:
    import mlx.core as mx

    from runtime.backends.mlx.facts import widen_half_quantized

    if path not in _CACHE:
        _CACHE.clear()  # one model in memory at a time
        model, tokenizer = load(path)
        if mx.default_device() == mx.cpu:
            widen_half_quantized(model)  # what the runtime's load does on a CPU
        _CACHE[path] = (model, tokenizer)
    return _CACHE[path]


def main(argv: list[str] | None = None) -> int:
    from runtime.backends.model_source import prepare_model
    from runtime.messages import ModelSpec

    parser = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        for fmt in args.formats.split(","):
            spec = ModelSpec(name=model, path=model, options={"weights": fmt})
            began = time.perf_counter()
            prepared = prepare_model(spec)
            prepare_s = time.perf_counter() - began
            disk = sum(f.stat().st_size for f in prepared.path.iterdir())
            samples = [
                _measure(str(prepared.path), args.prompt_tokens, args.decode_tokens)
                for _ in range(args.reps)
            ]
            row = {
                "model": model,
                "weights": fmt,
                "prefill_tok_s": round(statistics.median(s[0] for s in samples), 1),
                "decode_tok_s": round(statistics.median(s[1] for s in samples), 1),
                "disk_mb": round(disk / 1e6),
                "prepare_s": round(prepare_s, 1),
                "samples": [[round(a, 1), round(b, 1)] for a, b in samples],
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
    header = f"{'model':24} {'weights':10} {'prefill tok/s':>14} {'decode tok/s':>13} {'MB':>6}"
    print("\n" + header, file=sys.stderr)
    for r in rows:
        print(f"{r['model']:24} {r['weights']:10} {r['prefill_tok_s']:>14} "
              f"{r['decode_tok_s']:>13} {r['disk_mb']:>6}", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
