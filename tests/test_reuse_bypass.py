"""``generate(reuse_prefix=False)`` (the HTTP ``cache_prompt: false``): the whole prompt is
prefilled, nothing restored, and what it computes is still cached for the requests after it."""

from __future__ import annotations

import anyio
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Cancelled, ModelSpec, ReusePath
from runtime.testing.harness import ModelOption, engine_stats, sim_spec, wait_until

pytestmark = pytest.mark.anyio


def sim_model(**options: ModelOption) -> ModelSpec:
    return sim_spec("m", chunk=8, **options)


def config() -> RuntimeConfig:
    return RuntimeConfig(kv_budget_bytes=64 << 20)


def expected(prompt: str, n: int) -> str:
    return bytes(greedy_continuation(list(prompt.encode()), n)).decode()


@pytest.mark.parametrize("trimmable", [True, False])
async def test_a_request_without_reuse_prefills_everything_and_still_caches(
    trimmable: bool,
) -> None:
    prompt = "a system prompt and a question"
    async with Runtime(config()) as rt:
        loaded = await rt.load_model(sim_model(trimmable=trimmable))
        first = await rt.complete("m", prompt, max_tokens=3)

        def prefilled() -> int:
            return engine_stats(rt, loaded).counters.get("prefilled_tokens", 0)

        before = prefilled()
        cold = await rt.complete("m", prompt, max_tokens=3, reuse_prefix=False)
        assert prefilled() - before == len(prompt)  # every prompt token, none restored
        assert cold.started is not None and cold.started.path is ReusePath.MISS
        assert cold.started.cached_tokens == 0 and cold.usage.cached_prompt_tokens == 0
        assert cold.text == first.text == expected(prompt, 3)
        assert engine_stats(rt, loaded).counters["lookups_skipped"] == 1
        warm = await rt.complete("m", prompt, max_tokens=3)  # reuse is back for the next one
        assert warm.started is not None and warm.started.cached_tokens > 0


async def test_a_request_without_reuse_does_not_adopt_a_prewarm_it_extends() -> None:
    async with Runtime(config()) as rt, anyio.create_task_group() as tg:
        loaded = await rt.load_model(sim_model(prefill_s_per_token=0.002))
        outcome: list[object] = []

        async def warm() -> None:
            outcome.append(await rt.prewarm("m", "w" * 200, session="s"))

        tg.start_soon(warm)
        await wait_until(
            rt, lambda: engine_stats(rt, loaded).counters.get("prefilled_tokens", 0) > 0
        )
        result = await rt.complete(
            "m", "w" * 200 + "?", max_tokens=2, session="s", reuse_prefix=False
        )
    assert result.started is not None and result.started.path is ReusePath.MISS
    assert result.started.cached_tokens == 0
    assert result.text == expected("w" * 200 + "?", 2)
    # Not adopted but superseded, as a generate of its session supersedes a prewarm it diverges
    # from: the prewarm's work could not be used.
    assert isinstance(outcome[0], Cancelled) and outcome[0].reason == "superseded"
