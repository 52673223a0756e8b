"""Branching near the end, measured (the figures in docs/reuse.md, "Branching near the end").

For each model and each notes length: numbered notes with a question on the last line, then the
same notes with another question. Prints what the second request reused and re-processed, and
the checkpoints the first one's entry kept (points and their bytes). Uses only the public
``Runtime`` API and engine statistics, so the same script measures any checkout: run it with
that checkout on ``PYTHONPATH``.

    PYTHONPATH=. LD_PRELOAD=$(sh scripts/blas-preload.sh) .venv/bin/python scripts/measure_branch.py

Models: the tiny random-weight sliding and hybrid models, and (``--real``) the float32
SmolLM2-135M and Gemma 3 270M when they are converted locally.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import anyio
from mlx_lm.utils import load_tokenizer

from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.testing.harness import wait_until
from runtime.testing.tiny_models import tiny_model_path

CONVERTED = Path.home() / ".cache/mlx-actor-runtime/converted"
REAL = {
    "smollm2-135m": CONVERTED / "b179c9523d0e6a0f-float32-v1",
    "gemma3-270m": CONVERTED / "a5fd3b62230aa5ec-float32-v1",
}
BUDGET = 4 << 30
_WORD_TEXT = (
    "the keeper climbed tower every evening with oil trimmed wicks polished brass cleaned lens "
    "ships passed reef storm fog bell rang night sea calm light burning logbook wrote weather"
)
WORDS = tuple(_WORD_TEXT.split(" "))
QUESTIONS = (
    "Question: which of these notes mentions the sea, and what does it say?",
    "Question: how many of these notes talk about the fog or the bell?",
)


def notes(tokenizer: object, target: int) -> str:
    rng = random.Random(target)
    lines: list[str] = []
    while len(tokenizer.encode("\n".join(lines))) < target:  # type: ignore[attr-defined]
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16)))
        lines.append(f"Note {len(lines) + 1}: {words.capitalize()}.")
    return "\n".join(lines)


async def measure(name: str, path: Path) -> list[str]:
    tokenizer = load_tokenizer(path)
    rows = []
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET)) as rt:
        loaded = await rt.load_model(ModelSpec(name=name, backend="mlx", path=str(path)))
        for size in (900, 1800):
            text = notes(tokenizer, size)
            first, second = (f"{text}\n{q}" for q in QUESTIONS)
            before = _gauges(rt, name)
            await rt.complete(name, prompt=first, max_tokens=2, namespace=f"n{size}")
            entries = before["entries"]
            await wait_until(rt, lambda: _gauges(rt, name)["entries"] > entries)  # noqa: B023
            after = _gauges(rt, name)
            done = await rt.complete(name, prompt=second, max_tokens=2, namespace=f"n{size}")
            assert done.started is not None
            points = after["entry_points"] - before["entry_points"]
            point_bytes = after["entry_point_bytes"] - before["entry_point_bytes"]
            rows.append(
                f"{name} ({loaded.reuse_path}) ~{size} tokens of notes: re-sent with the last "
                f"line changed ({done.started.prompt_tokens} tokens), reused "
                f"{done.started.cached_tokens}, re-processed "
                f"{done.started.prompt_tokens - done.started.cached_tokens}; the first entry "
                f"kept {points} checkpoints, {point_bytes / 2**20:.2f} MiB"
            )
    return rows


def _gauges(rt: Runtime, name: str) -> dict[str, int]:
    engine = next(s for a, s in rt.stats().actors.items() if a.startswith(f"engine:{name}#"))
    return dict(engine.gauges)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="also SmolLM2-135M and Gemma 3 270M")
    args = parser.parse_args()
    models = [
        ("tiny-sliding", tiny_model_path("sliding")),
        ("tiny-hybrid", tiny_model_path("hybrid")),
    ]
    if args.real:
        models += [(name, path) for name, path in REAL.items() if path.is_dir()]
    for model in models:
        print("\n".join(anyio.run(measure, *model)), flush=True)


if __name__ == "__main__":
    main()
