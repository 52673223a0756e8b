"""Chat on a real (tiny) MLX model: its template, its end-of-turn tokens, prewarm then generate."""

from __future__ import annotations

import pytest

from runtime.api import Runtime
from runtime.config import RuntimeConfig
from runtime.messages import ChatMessage, Finished, FinishReason, ModelSpec, ReusePath
from runtime.mlx_backend import MlxBackend
from runtime.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.anyio

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
