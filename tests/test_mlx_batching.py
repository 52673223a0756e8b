"""Batched decoding on real (tiny) MLX models equals decoding alone."""

from __future__ import annotations

import anyio
import pytest

from runtime.api import Runtime
from runtime.config import RuntimeConfig
from runtime.messages import Finished, Generate, ModelLoaded, ModelSpec, Sampling, TokensEmitted
from runtime.testing.simulator import Simulator
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


def test_a_model_mlx_lm_cannot_batch_decodes_concurrent_streams_one_by_one() -> None:
    # kv_bits: mlx-lm has no batched quantized cache, so the engine never opens a batch for it.
    sim = Simulator(seed=0, config=RuntimeConfig(kv_budget_bytes=1 << 28))
    path = str(tiny_model_path("llama"))
    spec = ModelSpec(name="q", path=path, backend="mlx", options={"kv_bits": 8})
    assert isinstance(sim.load(spec), ModelLoaded)
    for index, prompt in enumerate(PROMPTS):
        sim.send(Generate(request_id=f"r{index}", incarnation=1, model="q", prompt=prompt,
                          max_tokens=6))  # fmt: skip
    sim.run_until_quiescent()
    for index in range(len(PROMPTS)):
        finished = sim.terminal(f"r{index}", 1)
        assert isinstance(finished, Finished) and finished.usage.completion_tokens == 6
    counters = sim.core("engine:q#1").counters  # type: ignore[union-attr]
    assert counters["batch_steps"] == 0 and counters["decoded_tokens"] > 0
