"""SmolLM2 in an engine process of its own (a Ray actor) streams the same greedy text as in the
host's process, with the same prefix reuse: the turns of a conversation reuse the same number of
cached tokens and prefill the same number of new ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import anyio
import pytest

from runtime.backends.model_source import prepare_model
from runtime.cluster.options import ClusterConfig
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Finished, ModelSpec
from runtime.testing.harness import engine_stats
from tests.loop_checks import LoopBackend, on_asyncio

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.real_model]

NAME = "smollm2-135m-instruct"
CLUSTER = ClusterConfig(num_cpus=2)
TURNS = (
    "The lighthouse at Carrow Point was built in 1852, after three ships were lost on the reef.",
    " Its keeper, Elias Morrow, kept a log of every storm for forty years.",
    " In 1901 the lamp was replaced by an electric one, and the log ends there.",
)


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    return on_asyncio()


@pytest.fixture(scope="module")
def smollm2(real_gguf: Callable[[str], object]) -> Iterator[ModelSpec]:
    real_gguf(NAME)  # skips (or fails under CI) like every real-model test
    spec = ModelSpec(name=NAME, path=NAME)
    prepare_model(spec)  # converted once here; the engine's process finds it cached
    from runtime.cluster.connect import connect

    link = connect(CLUSTER)
    yield spec
    link.close()


async def conversation(config: RuntimeConfig, spec: ModelSpec) -> list[tuple[str, int, int]]:
    """Each turn's greedy text, its cached prompt tokens, and the engine's prefilled tokens so far
    (a Ray engine's counters come with the mail that carried the turn's end)."""
    out = []
    async with Runtime(config) as rt:
        loaded = await rt.load_model(spec)
        prompt = ""
        for turn in TURNS:
            prompt += turn
            done = await rt.complete(NAME, prompt, max_tokens=12)
            assert isinstance(done.terminal, Finished)
            prefilled = engine_stats(rt, loaded).counters["prefilled_tokens"]
            out.append((done.text, done.usage.cached_prompt_tokens, prefilled))
            prompt += done.text
    return out


async def test_smollm2_in_a_ray_engine_streams_and_reuses_as_in_process(smollm2: ModelSpec) -> None:
    with anyio.fail_after(600):
        local = await conversation(RuntimeConfig(kv_budget_bytes=1 << 30), smollm2)
        remote = await conversation(
            RuntimeConfig(kv_budget_bytes=1 << 30, cluster=CLUSTER), smollm2
        )
    assert remote == local
    assert all(cached > 0 for _, cached, _ in local[1:])  # later turns reused earlier ones
