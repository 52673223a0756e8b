"""Batched decoding on real (tiny) MLX models equals decoding alone."""

from __future__ import annotations

import anyio
import pytest

from runtime.api import Runtime
from runtime.config import RuntimeConfig
from runtime.messages import ModelSpec, Sampling, TokensEmitted
from runtime.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

PROMPTS = ("The weather today is", "def add(a, b):\n    return", "Once upon a time, in a land far")
WITH_TOP5 = Sampling(logprobs=True, top_logprobs=5)


async def run(rt: Runtime, model: str, prompt: str) -> list[TokensEmitted]:
    async with rt.generate(model, prompt, max_tokens=12, sampling=WITH_TOP5) as stream:
        return [e async for e in stream if isinstance(e, TokensEmitted)]


def same_or_near_tie(batched: list[TokensEmitted], alone: list[TokensEmitted]) -> None:
    """Exact, or at the first divergence each side's token is in the other's top 5 (float order
    differs between batch shapes); comparison stops there."""
    for mine, theirs in zip(batched, alone, strict=False):
        a, b = mine.logprobs[0], theirs.logprobs[0]
        if a.token != b.token:
            assert a.token in {t for t, _ in b.top} and b.token in {t for t, _ in a.top}
            return
    assert len(batched) == len(alone)


@pytest.mark.parametrize("kind", ["llama", "sliding", "hybrid"])
async def test_concurrent_streams_match_their_solo_runs(kind: str) -> None:
    spec = ModelSpec(name=kind, path=str(tiny_model_path(kind)), backend="mlx")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec)
        alone = [await run(rt, kind, p) for p in PROMPTS]
        await rt.reset(kind)
        batched: list[list[TokensEmitted]] = [[] for _ in PROMPTS]

        async def one(index: int) -> None:
            batched[index] = await run(rt, kind, PROMPTS[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(PROMPTS)):
                tg.start_soon(one, index)
        counters = rt.stats().actors[f"engine:{kind}#1"].counters
        assert counters["batch_steps"] > 0 and counters["batch_joins"] >= 2
        for got, want in zip(batched, alone, strict=True):
            same_or_near_tie(got, want)
