"""Chat on a real (tiny) MLX model: its template, its end-of-turn tokens, prewarm then generate."""

from __future__ import annotations

import pytest

from runtime.backends.mlx.backend import MlxBackend
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, Finished, FinishReason, ModelSpec, ReusePath
from runtime.testing.tiny_models import tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


CHAT = [
    ChatMessage(role="system", content="You are terse."),
    ChatMessage(role="user", content="Name a colour."),
]


def spec() -> ModelSpec:
    return ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")


def test_end_of_turn_tokens_join_the_eos_set() -> None:
    backend = MlxBackend.load(spec())
    vocab = backend.chat_tokenizer.get_vocab()
    assert {vocab["<|im_end|>"], vocab["</s>"]} <= backend.info.eos_token_ids
    backend.close()


async def test_prewarmed_chat_is_reused_exactly_and_equals_cold() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec())
        cold = await rt.complete("llama", messages=CHAT, max_tokens=6)
        await rt.reset("llama")
        warm = await rt.prewarm("llama", messages=CHAT)
        assert isinstance(warm, Finished) and warm.reason is FinishReason.PREWARMED
        hot = await rt.complete("llama", messages=CHAT, max_tokens=6)
        assert hot.started is not None and hot.started.path is ReusePath.EXACT
        assert hot.started.cached_tokens == hot.started.prompt_tokens - 1
        assert hot.token_ids == cold.token_ids
        assert "<|im_start|>" not in hot.text


async def test_unload_through_the_runtime_returns_mlx_memory_to_its_baseline() -> None:
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    baseline = mx.get_active_memory()
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec())
        await rt.complete("llama", "fill some cache " * 20, max_tokens=8)
        assert mx.get_active_memory() > baseline + (1 << 20)  # weights and cached prefixes
        await rt.unload_model("llama")
        # No collection here: the weights go by their reference counts (MlxBackend.close).
        assert mx.get_active_memory() <= baseline + (1 << 20)


async def test_a_system_prompt_is_checkpointed_for_other_conversations() -> None:
    hybrid = ModelSpec(name="hybrid", path=str(tiny_model_path("hybrid")), backend="mlx")
    system = ChatMessage(role="system", content="You answer in one word, politely, always.")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(hybrid)
        await rt.complete(
            "hybrid", messages=[system, ChatMessage(role="user", content="Hi")], max_tokens=2
        )
        other = await rt.complete(
            "hybrid",
            messages=[system, ChatMessage(role="user", content="Something else")],
            max_tokens=2,
        )
        assert other.started is not None and other.started.path is ReusePath.CHECKPOINT
        assert other.started.cached_tokens >= 10  # at least the rendered system message
