"""Qwen2-VL and Qwen2.5-VL: M-RoPE grid positions kept by a cache layer (vision/mrope.py).

Tiny random-weight directories (runtime/testing/tiny_qwen_vl.py) whose image's position extent
differs from its token count, so a position taken from the token offset changes the logits (the
first test shows it): greedy output with reuse, chunked prefill or a batch equals one cold pass.
"""

from __future__ import annotations

import io
import threading
from collections.abc import AsyncIterator

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.vision.media import is_media
from runtime.host.api import Completion, Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    ChatMessage,
    ChatOptions,
    Finished,
    ImagePart,
    ModelSpec,
    ReusePath,
    VideoPart,
)
from runtime.testing.tiny_qwen_vl import QWEN_KINDS, QwenKind, tiny_qwen_vl_path
from runtime.text.chat import prepare_chat

pytestmark = [pytest.mark.anyio, pytest.mark.mlx]
SOFT_TOKENS = 8  # a 32 x 64 image: 4 x 8 patches of 8, merged 2 x 2


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def pixels(seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(32, 64, 3) * 255).astype(np.uint8)


def png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels(seed)).save(out, format="PNG")
    return out.getvalue()


def ask(text: str, *images: bytes) -> ChatMessage:
    return ChatMessage(role="user", content=text, images=tuple(ImagePart(data=i) for i in images))


def spec(kind: QwenKind) -> ModelSpec:
    return ModelSpec(name=kind, path=str(tiny_qwen_vl_path(kind)), backend="mlx")


def prompt(backend: MlxBackend, seed: int) -> list[int]:
    messages = backend.prepare_media((ask("What is <|image|> here?", png(seed)),))
    prepared = prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048)
    return list(prepared.tokens)


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_positions_are_the_models_own_cold_pass_and_naive_offsets_differ(kind: QwenKind) -> None:
    backend = MlxBackend.load(spec(kind))
    try:
        tokens = prompt(backend, 1)
        assert sum(map(is_media, tokens)) == SOFT_TOKENS
        store = backend._media.store  # type: ignore[union-attr]
        vlm = backend.model.vlm
        out = store._processor(text=[store.marker], images=[Image.fromarray(pixels(1))])
        raw = mx.array([[store.image_token if is_media(t) else t for t in tokens]])
        grid = mx.array(np.asarray(out["image_grid_thw"]))
        values = mx.array(np.asarray(out["pixel_values"]))
        cold = vlm(raw, values, image_grid_thw=grid).logits[0, -1]
        embeds = vlm.get_input_embeddings(raw, values, image_grid_thw=grid).inputs_embeds
        naive_ids = mx.broadcast_to(mx.arange(raw.shape[1])[None, None], (3, 1, raw.shape[1]))
        naive = vlm.language_model(raw, inputs_embeds=embeds, position_ids=naive_ids)
        state = backend.new_state()
        backend.prefill(state, tokens)
        ours = backend.logits(state)
        assert mx.allclose(ours, cold, atol=1e-4)
        assert not mx.allclose(naive.logits[0, -1], cold, atol=1e-2)  # positions matter here
        # The price is the cache the prompt really fills (within 10%).
        real = backend.state_nbytes(state)
        assert real <= backend.info.kv_bytes(len(tokens)) <= 1.1 * real
        assert backend.batch_decode  # the load probe found batched decoding exact
    finally:
        backend.close()


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_chunked_prefill_and_a_restored_prefix_equal_one_pass(kind: QwenKind) -> None:
    backend = MlxBackend.load(spec(kind))
    try:
        tokens = prompt(backend, 2)
        whole = backend.new_state()
        backend.prefill(whole, tokens)
        chunked = backend.new_state()
        for at in range(0, len(tokens), 3):  # chunks of 3 end inside the image's span
            backend.prefill(chunked, tokens[at : at + 3])
        assert mx.allclose(backend.logits(chunked), backend.logits(whole), atol=1e-4)
        first = next(i for i, t in enumerate(tokens) if is_media(t))
        for cut in (first + 3, first + SOFT_TOKENS + 1):  # inside the span, and past it
            resumed = backend.copy_state(whole, cut)
            backend.prefill(resumed, tokens[cut:])
            assert mx.allclose(backend.logits(resumed), backend.logits(whole), atol=1e-4)
        for state in (whole, chunked):  # and the decode steps after it
            backend.feed(state, mx.array(7))
        assert mx.allclose(backend.logits(chunked), backend.logits(whole), atol=1e-4)
    finally:
        backend.close()


@pytest.fixture(params=QWEN_KINDS)
async def qwen(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Runtime, str]]:
    kind: QwenKind = request.param
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(kind))
        yield rt, kind


async def greedy(rt: Runtime, model: str, messages: list[ChatMessage]) -> Completion:
    done = await rt.complete(model, messages=messages, max_tokens=6)
    assert isinstance(done.terminal, Finished), done.terminal
    return done


async def test_the_same_image_in_turn_two_reuses_and_equals_cold(
    qwen: tuple[Runtime, str],
) -> None:
    rt, model = qwen
    turn1 = [ask("Describe this picture.", png(1))]
    first = await greedy(rt, model, turn1)
    turn2 = [
        *turn1,
        ChatMessage(role="assistant", content=first.text),
        ChatMessage(role="user", content="And its colours?"),
    ]
    warm = await greedy(rt, model, turn2)
    assert warm.started is not None and warm.started.path is not ReusePath.MISS
    assert warm.started.cached_tokens > SOFT_TOKENS
    await rt.reset(model)
    cold = await greedy(rt, model, turn2)
    assert cold.started is not None and cold.started.cached_tokens == 0
    assert warm.token_ids == cold.token_ids


async def test_a_different_image_never_reuses_and_text_keeps_reuse(
    qwen: tuple[Runtime, str],
) -> None:
    rt, model = qwen
    await greedy(rt, model, [ask("Describe this picture.", png(1))])
    other = await greedy(rt, model, [ask("Describe this picture.", png(2))])
    assert other.started is not None
    assert other.started.cached_tokens < other.started.prompt_tokens - SOFT_TOKENS
    await rt.reset(model)
    cold = await greedy(rt, model, [ask("Describe this picture.", png(2))])
    assert other.token_ids == cold.token_ids
    chat = [ChatMessage(role="user", content="Name a colour.")]
    text = await greedy(rt, model, chat)
    again = await greedy(rt, model, chat)
    assert again.started is not None
    assert again.started.cached_tokens == again.started.prompt_tokens - 1
    assert text.token_ids == again.token_ids


async def test_concurrent_image_streams_equal_each_alone(qwen: tuple[Runtime, str]) -> None:
    import anyio

    rt, model = qwen
    chats = [[ask(f"Picture {i}?", png(10 + i))] for i in range(3)]
    together: dict[int, list[int]] = {}

    async def run(i: int) -> None:
        together[i] = (await greedy(rt, model, chats[i])).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(run, i)
    for i in range(3):
        await rt.reset(model)
        assert (await greedy(rt, model, chats[i])).token_ids == together[i]


class TripsAt(threading.Event):
    """A stop flag that reads as set from its ``at``-th check on."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.checks = 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.at


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_an_abort_stops_the_qwen_tower_between_its_blocks(kind: QwenKind) -> None:
    from runtime.backends.contract import PrefillInterrupted
    from runtime.backends.vision.tower import encoders

    backend = MlxBackend.load(spec(kind))
    try:
        tokens = prompt(backend, 3)
        store = backend._media.store  # type: ignore[union-attr]
        (encoder,) = encoders(store._model)
        blocks = list(encoder["blocks"])
        assert len(blocks) == 2
        stop = TripsAt(3)  # check 1 is encode's, before the image; 2 and 3 the blocks'
        with pytest.raises(PrefillInterrupted, match="inside an image's encoding"):
            store.encode(tokens, stop)
        assert stop.checks == 3 and encoder["blocks"] == blocks
        whole = backend.new_state()
        backend.prefill(whole, tokens)  # the image encodes again once not aborted
        assert backend.logits(whole).shape[0] > 0
    finally:
        backend.close()


async def test_a_prewarmed_image_chat_is_reused_exactly(qwen: tuple[Runtime, str]) -> None:
    rt, model = qwen
    chat = [ask("Describe this picture.", png(4))]
    warm = await rt.prewarm(model, messages=chat)
    assert isinstance(warm, Finished)
    done = await greedy(rt, model, chat)
    assert done.started is not None and done.started.path is ReusePath.EXACT
    await rt.reset(model)
    cold = await greedy(rt, model, chat)
    assert done.token_ids == cold.token_ids


def clip(seed: int, frames: int = 4) -> VideoPart:
    return VideoPart(frames=tuple(png(seed * 100 + k) for k in range(frames)), fps=2.0)


@pytest.mark.parametrize("kind", QWEN_KINDS)
def test_a_video_is_one_span_at_the_models_own_cold_positions(kind: QwenKind) -> None:
    backend = MlxBackend.load(spec(kind))
    try:
        message = ChatMessage(role="user", content="What happens?", videos=(clip(1),))
        messages = backend.prepare_media((message,))
        tokens = list(prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048).tokens)
        store = backend._media.store  # type: ignore[union-attr]
        vlm = backend.model.vlm
        frames = [Image.fromarray(pixels(100 + k)) for k in range(4)]
        video = store._processor.video_token_id
        out = store._processor(
            text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[frames]
        )
        raw = mx.array([[video if is_media(t) else t for t in tokens]])
        grid = mx.array(np.asarray(out["video_grid_thw"]))
        t, h, w = (int(x) for x in np.asarray(out["video_grid_thw"])[0])
        assert t == 2 and sum(map(is_media, tokens)) == t * h * w // 4  # the processor's count
        values = mx.array(np.asarray(out["pixel_values_videos"]))
        cold = vlm(raw, values, video_grid_thw=grid).logits[0, -1]
        state = backend.new_state()
        for at in range(0, len(tokens), 5):  # chunked, ending inside the video's span
            backend.prefill(state, tokens[at : at + 5])
        assert mx.allclose(backend.logits(state), cold, atol=1e-4)
    finally:
        backend.close()


async def test_the_same_video_in_turn_two_reuses_and_equals_cold(
    qwen: tuple[Runtime, str],
) -> None:
    rt, model = qwen
    turn1 = [ChatMessage(role="user", content="What happens?", videos=(clip(2),))]
    first = await greedy(rt, model, turn1)
    turn2 = [
        *turn1,
        ChatMessage(role="assistant", content=first.text),
        ChatMessage(role="user", content="And then?"),
    ]
    warm = await greedy(rt, model, turn2)
    assert warm.started is not None and warm.started.cached_tokens > 8  # past the video's span
    await rt.reset(model)
    cold = await greedy(rt, model, turn2)
    assert warm.token_ids == cold.token_ids
