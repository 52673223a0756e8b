"""Reuse past the anchors, measured (the figures in docs/reuse.md, "Measured").

For each model: what a prompt that diverges from a cached one after 265 tokens reuses, what
editing the last chat message reuses, and what the checkpoints of a long prompt cost (bytes per
snapshot, points and their bytes). Uses only the public ``Runtime`` API and engine statistics, so
the same script measures any checkout: run it with that checkout on ``PYTHONPATH``.

    PYTHONPATH=. LD_PRELOAD=$(sh scripts/blas-preload.sh) .venv/bin/python scripts/measure_reuse.py

Models: the tiny random-weight sliding and hybrid models, and the real float32 SmolLM2-135M
(full attention: the reference) and Gemma 3 270M when they are converted locally (``--real``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import anyio
from mlx_lm.utils import load_tokenizer

from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, ChatOptions, ModelSpec
from runtime.testing.harness import common_prefix_length
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.chat import prepare_chat

CONVERTED = Path.home() / ".cache/mlx-actor-runtime/converted"
REAL = {
    "smollm2-135m": CONVERTED / "b179c9523d0e6a0f-float32-v1",
    "gemma3-270m": CONVERTED / "a5fd3b62230aa5ec-float32-v1",
}
SHARED = 265  # tokens the two prompts share
BUDGET = 4 << 30
STORY = (
    "The keeper climbed the hundred and twelve steps every evening with a can of oil, trimmed "
    "the wicks, polished the brass and cleaned the great glass lens until it shone. "
)


def ids(n: int, seed: int, low: int, high: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


async def measure(
    name: str, path: Path, long_tokens: int, high: int, stories: int, every: int | None
) -> list[str]:
    options = {} if every is None else {"checkpoint_every_tokens": every}
    spec = ModelSpec(name=name, backend="mlx", path=str(path), options=options)
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET)) as rt:
        loaded = await rt.load_model(spec)
        rows = [f"{name}: reuse path {loaded.reuse_path}"]

        # A prompt that diverges after SHARED tokens (long enough that a sliding ring wraps).
        first = ids(max(SHARED + 40, 700 if "gemma" in name else 300), 1, 5, high)
        second = first[:SHARED] + ids(40, 2, 5, high)
        await rt.complete(name, prompt_tokens=first, max_tokens=2, namespace="diverge")
        done = await rt.complete(name, prompt_tokens=second, max_tokens=2, namespace="diverge")
        assert done.started is not None
        rows.append(
            f"  diverging after {SHARED} of {len(first)} tokens: reused "
            f"{done.started.cached_tokens} ({done.started.path})"
        )

        # Editing the last chat message (of a conversation long enough that a ring wraps).
        history = [
            ChatMessage("system", "You answer questions about lighthouses in one short line."),
            ChatMessage("user", f"Read this: {STORY * stories}"),
            ChatMessage("assistant", f"In short: {STORY * stories}"),
        ]
        asked = [*history, ChatMessage("user", "When did he climb the steps?")]
        edited = [*history, ChatMessage("user", "Why did he polish the brass?")]
        await rt.complete(name, messages=asked, max_tokens=2, namespace="chat")
        done = await rt.complete(name, messages=edited, max_tokens=2, namespace="chat")
        assert done.started is not None
        tokenizer = load_tokenizer(path)
        a, b = (prepare_chat(tokenizer, m, ChatOptions(), 2, 4096).tokens for m in (asked, edited))
        rows.append(
            f"  chat, last message edited ({len(b)} tokens, {common_prefix_length(a, b)} shared, "
            f"the last message's header included): reused {done.started.cached_tokens} "
            f"({done.started.path})"
        )

        # The checkpoints of one long prompt.
        before = _gauges(rt, name)
        prompt = ids(long_tokens, 3, 5, high)
        await rt.complete(name, prompt_tokens=prompt, max_tokens=1, namespace="long")
        after = _gauges(rt, name)
        points = after["entry_points"] - before["entry_points"]
        point_bytes = after["entry_point_bytes"] - before["entry_point_bytes"]
        entry_bytes = after["entry_bytes"] - before["entry_bytes"]
        per = point_bytes // points if points else 0
        rows.append(
            f"  {long_tokens}-token prompt: {points} checkpoints, {per / 1024:.1f} KiB each, "
            f"{point_bytes / 2**20:.2f} MiB in all; entry {entry_bytes / 2**20:.2f} MiB with them"
        )
        return rows


def _gauges(rt: Runtime, name: str) -> dict[str, int]:
    engine = next(s for a, s in rt.stats().actors.items() if a.startswith(f"engine:{name}#"))
    return dict(engine.gauges)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="also SmolLM2-135M and Gemma 3 270M")
    parser.add_argument("--every", type=int, help="the models' checkpoint_every_tokens option")
    args = parser.parse_args()
    # (name, path, long prompt tokens, token ids below, story repeats per chat message)
    models: list[tuple[str, Path, int, int, int]] = [
        ("tiny-sliding", tiny_model_path("sliding"), 1900, 500, 3),
        ("tiny-hybrid", tiny_model_path("hybrid"), 1900, 500, 3),
    ]
    if args.real:
        models += [(name, path, 2048, 20000, 9) for name, path in REAL.items() if path.is_dir()]
    for model in models:
        print("\n".join(anyio.run(measure, *model, args.every)), flush=True)


if __name__ == "__main__":
    main()
