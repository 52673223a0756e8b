"""Batched decoding on real (tiny) MLX models: equal to decoding alone, its memory paid for."""

from __future__ import annotations

import random

import anyio
import pytest

from runtime.backends.mlx.batch import DecodeBatch
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Finished,
    HolderKind,
    ModelLoaded,
    ModelSpec,
    Sampling,
    TokensEmitted,
)
from runtime.testing.harness import engine, engine_stats, kv_keeper, make_sim
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


PROMPTS = ("The weather today is", "def add(a, b):\n    return", "Once upon a time, in a land far")
WITH_TOP5 = Sampling(logprobs=True, top_logprobs=5)
MLX_ALLOC_STEP = 256  # mlx-lm's KVCache / BatchKVCache ``step``


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
        loaded = await rt.load_model(spec)
        alone = [await run(rt, kind, p) for p in PROMPTS]
        await rt.reset(kind)
        batched: list[list[TokensEmitted]] = [[] for _ in PROMPTS]

        async def one(index: int) -> None:
            batched[index] = await run(rt, kind, PROMPTS[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(PROMPTS)):
                tg.start_soon(one, index)
        counters = engine_stats(rt, loaded).counters
        assert counters["batch_steps"] > 0 and counters["batch_joins"] >= 2
        for got, want in zip(batched, alone, strict=True):
            same_or_near_tie(got, want)


def test_a_model_mlx_lm_cannot_batch_decodes_concurrent_streams_one_by_one() -> None:
    # kv_bits: mlx-lm has no batched quantized cache, so the engine never opens a batch for it.
    path = str(tiny_model_path("llama"))
    spec = ModelSpec(name="q", path=path, backend="mlx", options={"kv_bits": 8})
    sim = make_sim(spec, budget=1 << 28)
    for index, prompt in enumerate(PROMPTS):
        sim.send(generate(f"r{index}", max_tokens=6, model="q", prompt=prompt))  # fmt: skip
    sim.run_until_quiescent()
    for index in range(len(PROMPTS)):
        finished = sim.terminal(f"r{index}", 1)
        assert isinstance(finished, Finished) and finished.usage.completion_tokens == 6
    counters = engine(sim, "q").counters
    assert counters["batch_steps"] == 0 and counters["decoded_tokens"] > 0


@pytest.mark.parametrize("kind", ["llama", "sliding", "hybrid"])
def test_the_padding_reservation_covers_what_the_real_batch_holds_beyond_its_members(
    kind: TinyModelKind,
) -> None:
    sim = Simulator(seed=0, config=RuntimeConfig(kv_budget_bytes=1 << 30))
    spec = ModelSpec(name=kind, path=str(tiny_model_path(kind)), backend="mlx")
    loaded = sim.load(spec)
    assert isinstance(loaded, ModelLoaded)
    core, kv = engine(sim, kind), kv_keeper(sim)
    beyond: list[tuple[int, int, int]] = []  # (bytes beyond the members', padding held, spare)

    def measure() -> None:
        batch = core.decode_batch
        if not isinstance(batch, DecodeBatch) or len(batch) < 2:
            return
        held = kv.holdings()
        # Both are in; what they hold for checkpoint snapshots is not batch memory.
        snapshots = core.statistics().gauges["sequence_snapshot_bytes"]
        own = sum(n for h, n in held.items() if h.kind is HolderKind.SEQUENCE) - snapshots
        padding = sum(n for h, n in held.items() if h.kind is HolderKind.BATCH_PADDING)
        # mlx-lm grows a batch cache 256 tokens at a time for every row: the padding reservation
        # prices up to 255 spare tokens per row too.
        spare = len(batch) * (MLX_ALLOC_STEP - 1) * loaded.bytes_per_token
        beyond.append((batch.nbytes - own, padding, spare))

    sim.check_every_step(measure)
    long_prompt = tuple(random.Random(1).randrange(5, 500) for _ in range(1500))
    sim.send(generate("long", long_prompt, 8, model=kind))  # fmt: skip
    sim.send(generate("short", (7, 8, 9, 10), 64, model=kind))  # fmt: skip
    sim.run_until_quiescent()

    assert beyond, "the two never shared a batch"
    for extra, padding, _ in beyond:
        assert extra <= padding  # every byte the batch holds is reserved
    # Without the padding reservation the batch would hold far more than was reserved, even
    # beyond the allocation steps' spare capacity.
    assert max(extra - spare for extra, _, spare in beyond) > 0
    assert not any(h.kind is HolderKind.BATCH_PADDING for h in kv.holdings())
