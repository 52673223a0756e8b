"""The disk tier on real pretrained weights (float32 on CPU, greedy): after an unload writes the
model's entries and a new load finds them, a longer prompt is served from disk, only its rest is
prefilled, and the output equals a cold run. SmolLM2-135M-Instruct reuses the whole first prompt
(``trim``); Gemma 3 270M, whose 512-token sliding rings wrap on this ~800-token prompt, restores
at one of the checkpoints its first prefill snapshotted (``checkpoint``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from runtime.backends.disk import DiskCacheConfig
from runtime.backends.model_source import prepare_model
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, ReusePath, ReuseTier
from runtime.testing.harness import engine_stats
from tests.loop_checks import LoopBackend, on_asyncio
from tests.test_real_model_reuse import CORPUS

pytestmark = [pytest.mark.real_model, pytest.mark.anyio]

MAX_TOKENS = 6
BUDGET = 4 << 30


@pytest.fixture(params=["smollm2-135m-instruct", "gemma3-270m"])
def model(request: pytest.FixtureRequest, real_gguf: Callable[[str], object]) -> str:
    real_gguf(request.param)  # skips (or fails under CI) like every real-model test
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def anyio_backend() -> LoopBackend:
    return on_asyncio()  # one event loop kind: these runs are long


def prompts(name: str) -> tuple[list[int], list[int]]:
    tokenizer = load_tokenizer(prepare_model(ModelSpec(name=name, path=name)).path)
    base = list(tokenizer.encode(" ".join(CORPUS[:6])))
    more = list(tokenizer.encode(" ".join(CORPUS[6:7]), add_special_tokens=False))
    return base, base + more[:60]


async def test_a_disk_hit_on_real_weights_equals_cold(model: str, tmp_path: Path) -> None:
    base, longer = prompts(model)
    spec = ModelSpec(name=model, path=model)
    disk = DiskCacheConfig(directory=str(tmp_path))
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET, disk_cache=disk)) as rt:
        await rt.load_model(spec)
        await rt.complete(model, prompt_tokens=base, max_tokens=MAX_TOKENS)
        await rt.unload_model(model)  # writes what RAM holds
        loaded = await rt.load_model(spec)  # RAM empty; the disk's index read at load
        result = await rt.complete(model, prompt_tokens=longer, max_tokens=MAX_TOKENS)
        stats = engine_stats(rt, loaded)
        # The cold run: a namespace of its own shares no entry, in RAM or on disk (no second
        # load of the model for it; the reuse tests take their cold runs the same way).
        reference = await rt.complete(
            model, prompt_tokens=longer, max_tokens=MAX_TOKENS, namespace="cold"
        )
    assert reference.started is not None
    assert (reference.started.tier, reference.started.cached_tokens) == (ReuseTier.COLD, 0)
    started = result.started
    assert started is not None
    assert started.tier is ReuseTier.DISK
    if model.startswith("smollm2"):
        assert (started.path, started.cached_tokens) == (ReusePath.TRIM, len(base))
    else:
        assert started.path is ReusePath.CHECKPOINT
        assert len(base) - 64 <= started.cached_tokens <= len(base)
    assert stats.counters["prefilled_tokens"] == len(longer) - started.cached_tokens
    assert result.token_ids == reference.token_ids
    assert stats.counters["disk_hits"] == 1
