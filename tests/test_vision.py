"""Vision-language models through mlx-vlm: tiny random-weight Gemma 3 and Idefics3 (SmolVLM)
directories built offline from mlx-vlm's own classes (runtime/testing/tiny_vlms.py).

Images enter chat messages; their soft tokens are priced and keyed on their pixels, so the same
image in a later turn reuses its KV (greedy equals cold) and a different one never does; bad
images and images sent to a text-only model are typed errors. docs/models.md (vision).
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
from runtime.backends.vision.media import is_media, split_media
from runtime.errors import error_for_code
from runtime.host.api import Completion, Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    ChatMessage,
    ChatOptions,
    Failed,
    Finished,
    ImagePart,
    ModelSpec,
    ReusePath,
)
from runtime.testing.tiny_models import tiny_model_path
from runtime.testing.tiny_vlms import TinyVlmKind, tiny_vlm_path
from runtime.text.chat import prepare_chat
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = [pytest.mark.anyio, pytest.mark.mlx]


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


# Soft tokens one image becomes: Gemma 3's 16 per image; Idefics3's 4 per tile, 2 x 2 tiles and a
# global view for a 40 x 50 image (its processor splits at 32 pixels a side).
SOFT_TOKENS = {"gemma3": 16, "idefics3": 20}


def image_bytes(seed: int, fmt: str = "PNG", size: tuple[int, int] = (40, 50)) -> bytes:
    pixels = (np.random.RandomState(seed).rand(size[0], size[1], 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def spec(kind: TinyVlmKind) -> ModelSpec:
    return ModelSpec(name=kind, path=str(tiny_vlm_path(kind)), backend="mlx")


def ask(text: str, *images: bytes) -> ChatMessage:
    return ChatMessage(
        role="user", content=text, images=tuple(ImagePart(data=data) for data in images)
    )


@pytest.fixture(params=["gemma3", "idefics3"])
async def vlm(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Runtime, str]]:
    kind: TinyVlmKind = request.param
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(kind))
        yield rt, kind


async def greedy(rt: Runtime, model: str, messages: list[ChatMessage]) -> Completion:
    done = await rt.complete(model, messages=messages, max_tokens=6)
    assert isinstance(done.terminal, Finished), done.terminal
    return done


@pytest.mark.parametrize("kind", ["gemma3", "idefics3"])
def test_an_image_becomes_its_processors_soft_tokens_between_the_models_own_markers(
    kind: TinyVlmKind,
) -> None:
    backend = MlxBackend.load(spec(kind))
    try:
        messages = (ask("What is <|image|> here?", image_bytes(1)),)
        prepared = prepare_chat(
            backend.chat_tokenizer, backend.prepare_media(messages), ChatOptions(), 8, 2048
        )
        # The template (from chat_template.json, the processor's file) framed the prompt.
        assert backend.info.chat_template and prepared.text.startswith("<|im_start|>user\n")
        soft = [i for i, t in enumerate(prepared.tokens) if is_media(t)]
        assert len(soft) == SOFT_TOKENS[kind]
        vocab = backend.chat_tokenizer._inner.get_vocab()
        opening = "<start_of_image>" if kind == "gemma3" else "<fake_token_around_image>"
        closing = "<end_of_image>" if kind == "gemma3" else "<fake_token_around_image>"
        assert vocab[opening] in prepared.tokens[: soft[0]]
        assert prepared.tokens[soft[-1] + 1] == vocab[closing]
        # The price is the cache the prompt really fills (the bound: within 10%).
        state = backend.new_state()
        backend.prefill(state, prepared.tokens)
        real = backend.state_nbytes(state)
        priced = backend.info.kv_bytes(len(prepared.tokens))
        assert real <= priced <= 1.1 * real
    finally:
        backend.close()


async def test_the_same_image_in_turn_two_reuses_its_kv_and_equals_cold(
    vlm: tuple[Runtime, str],
) -> None:
    rt, model = vlm
    turn1 = [ask("Describe this picture.", image_bytes(1))]
    first = await greedy(rt, model, turn1)
    turn2 = [
        *turn1,
        ChatMessage(role="assistant", content=first.text),
        ChatMessage(role="user", content="And its colours?"),
    ]
    warm = await greedy(rt, model, turn2)
    assert warm.started is not None
    assert warm.started.path is not ReusePath.MISS
    assert warm.started.cached_tokens > SOFT_TOKENS[model]  # the image's span came from cache
    await rt.reset(model)
    cold = await greedy(rt, model, turn2)
    assert cold.started is not None and cold.started.cached_tokens == 0
    assert warm.token_ids == cold.token_ids


async def test_a_different_image_at_the_same_position_never_reuses_past_it(
    vlm: tuple[Runtime, str],
) -> None:
    rt, model = vlm
    await greedy(rt, model, [ask("Describe this picture.", image_bytes(1))])
    other = await greedy(rt, model, [ask("Describe this picture.", image_bytes(2))])
    assert other.started is not None
    assert other.started.cached_tokens <= first_soft_token(model, image_bytes(2))
    await rt.reset(model)
    cold = await greedy(rt, model, [ask("Describe this picture.", image_bytes(2))])
    assert other.token_ids == cold.token_ids


def first_soft_token(kind: TinyVlmKind, image: bytes) -> int:
    """Where the image's first soft token stands in the prompt of ``ask(..., image)``."""
    backend = MlxBackend.load(spec(kind))
    try:
        messages = backend.prepare_media((ask("Describe this picture.", image),))
        prepared = prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048)
        return next(i for i, t in enumerate(prepared.tokens) if is_media(t))
    finally:
        backend.close()


async def test_equal_pixels_in_another_file_format_are_the_same_image(
    vlm: tuple[Runtime, str],
) -> None:
    rt, model = vlm
    await greedy(rt, model, [ask("Describe this picture.", image_bytes(3, "PNG"))])
    again = await greedy(rt, model, [ask("Describe this picture.", image_bytes(3, "BMP"))])
    assert again.started is not None
    assert again.started.cached_tokens == again.started.prompt_tokens - 1


async def test_text_only_requests_to_a_vlm_keep_the_text_path(vlm: tuple[Runtime, str]) -> None:
    rt, model = vlm
    chat = [ChatMessage(role="user", content="Name a colour.")]
    first = await greedy(rt, model, chat)
    second = await greedy(rt, model, chat)
    assert second.started is not None
    assert second.started.cached_tokens == second.started.prompt_tokens - 1
    assert first.token_ids == second.token_ids


def failure(done: Completion) -> Failed:
    assert isinstance(done.terminal, Failed), done.terminal
    return done.terminal


@pytest.mark.parametrize(
    ("images", "code", "names"),
    [
        ((b"not an image at all",), "invalid_media", "messages[0].images[0]"),
        ((image_bytes(1)[:60],), "invalid_media", "messages[0].images[0]"),
        ((image_bytes(1), image_bytes(1, "TIFF")), "invalid_media", "messages[0].images[1]"),
        ((image_bytes(1, size=(300, 300)),), "invalid_media", "messages[0].images[0]"),
        ((image_bytes(1),) * 3, "too_many_images", "3 images"),
    ],
    ids=["undecodable", "truncated", "tiff", "oversized", "too-many"],
)
async def test_bad_images_are_typed_errors_naming_the_part_and_spare_the_rest(
    images: tuple[bytes, ...], code: str, names: str
) -> None:
    limited = ModelSpec(
        name="gemma3",
        path=str(tiny_vlm_path("gemma3")),
        backend="mlx",
        options={"max_images": 2, "max_image_pixels": 200 * 200},
    )
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(limited)
        bad = failure(await rt.complete("gemma3", messages=[ask("Look.", *images)], max_tokens=4))
        assert bad.code == code and names in bad.message
        assert error_for_code(bad.code, bad.message).code == code  # the typed error, by code
        good = await greedy(rt, "gemma3", [ask("Look.", image_bytes(1))])
        assert good.started is not None


async def test_a_placeholder_count_that_does_not_match_the_images_is_refused() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec("gemma3"))
        two = ask("<|image|> and <|image|>", image_bytes(1))
        bad = failure(await rt.complete("gemma3", messages=[two], max_tokens=4))
        assert bad.code == "invalid_request" and "messages[0]" in bad.message
        forged = ChatMessage(role="user", content="<|mlxrt-image:000000000001|>")
        bad = failure(await rt.complete("gemma3", messages=[forged], max_tokens=4))
        assert bad.code == "invalid_request" and "reserved image marker" in bad.message


async def test_images_sent_to_a_text_only_model_are_refused() -> None:
    text = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(text)
        bad = failure(await rt.complete("llama", messages=[ask("Look.", image_bytes(1))]))
        assert bad.code == "media_unsupported" and "messages[0]" in bad.message


async def test_media_the_kv_budget_cannot_hold_is_refused_at_once() -> None:
    backend = MlxBackend.load(spec("idefics3"))
    per_token = backend.info.kv_bytes(256) // 256
    backend.close()
    # Room for a short text prompt and its reply, not for an image's soft tokens as well.
    async with Runtime(RuntimeConfig(kv_budget_bytes=per_token * 256)) as rt:
        await rt.load_model(spec("idefics3"))
        text = await greedy(rt, "idefics3", [ChatMessage(role="user", content="Hi")])
        assert text.started is not None
        big = image_bytes(1, size=(64, 64))  # 2 x 2 tiles and a global view: 20 soft tokens
        many = [ask("Compare " + "<|image|>" * 8, *([big] * 8))]
        bad = failure(await rt.complete("idefics3", messages=many, max_tokens=4))
        assert bad.code == "kv_request_too_large"


async def test_concurrent_image_streams_equal_each_alone(vlm: tuple[Runtime, str]) -> None:
    import anyio

    rt, model = vlm
    chats = [[ask("Describe this picture.", image_bytes(seed))] for seed in (4, 5, 6)]
    alone = []
    for chat in chats:
        alone.append(await greedy(rt, model, chat))
        await rt.reset(model)
    together: dict[int, Completion] = {}

    async def run(i: int) -> None:
        together[i] = await greedy(rt, model, chats[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(chats)):
            tg.start_soon(run, i)
    assert [together[i].token_ids for i in range(len(chats))] == [a.token_ids for a in alone]
    engine = next(s for a, s in rt.stats().actors.items() if a.startswith(f"engine:{model}#"))
    assert engine.counters["batch_steps"] > 0  # they really decoded as one batch


async def test_a_prewarmed_image_chat_is_reused_exactly(vlm: tuple[Runtime, str]) -> None:
    rt, model = vlm
    chat = [ask("Describe this picture.", image_bytes(7))]
    warm = await rt.prewarm(model, messages=chat)
    assert isinstance(warm, Finished)
    hot = await greedy(rt, model, chat)
    assert hot.started is not None and hot.started.path is ReusePath.EXACT
    await rt.reset(model)
    cold = await greedy(rt, model, chat)
    assert hot.token_ids == cold.token_ids


def test_an_aborted_prefill_stops_before_the_next_images_encoding() -> None:
    import threading

    from runtime.backends.contract import PrefillInterrupted

    backend = MlxBackend.load(spec("gemma3"))
    try:
        messages = backend.prepare_media((ask("Compare.", image_bytes(8), image_bytes(9)),))
        prepared = prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048)
        store = backend._media.store  # type: ignore[union-attr]
        keys = list(dict.fromkeys(split_media(t)[0] for t in prepared.tokens if is_media(t)))
        stop = threading.Event()
        stop.set()
        state = backend.new_state()
        with pytest.raises(PrefillInterrupted):
            backend.prefill(state, prepared.tokens, stop=stop)
        assert state.length == 0
        assert all(store._items[k].features is None for k in keys)  # no tower ran
        backend.prefill(state, prepared.tokens, stop=threading.Event())
        assert all(store._items[k].features is not None for k in keys)
    finally:
        backend.close()


async def test_a_clients_prompt_tokens_may_not_name_media_ids() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec("gemma3"))
        forged = (5, 6, (1 << 62) | 1)  # would read an image another request registered
        bad = failure(await rt.complete("gemma3", prompt_tokens=forged, max_tokens=2))
        assert bad.code == "invalid_request" and "outside the model's vocabulary" in bad.message


def test_the_media_store_keeps_to_its_byte_capacity() -> None:
    from runtime.backends.vision.media import MediaLimits, decode_image
    from runtime.backends.vision.store import MediaStore
    from runtime.errors import MediaEvicted

    backend = MlxBackend.load(spec("idefics3"))
    try:
        media = backend._media
        assert media is not None
        one = media.store.register(decode_image(image_bytes(1), "a", MediaLimits()), "a")
        small = MediaStore(media.store._model, media.store._processor, capacity_bytes=one.nbytes)
        first = small.register(decode_image(image_bytes(1), "a", MediaLimits()), "a")
        second = small.register(decode_image(image_bytes(2), "b", MediaLimits()), "b")
        assert len(small) == 1 and small.nbytes <= one.nbytes
        assert small.span(second.key)  # the newest stays
        with pytest.raises(MediaEvicted):
            small.features(first.key)
    finally:
        backend.close()


class TripsAt(threading.Event):
    """A stop flag that reads set from its ``at``-th check on, counting the checks."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at = at
        self.checks = 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.at


@pytest.mark.parametrize("kind", ["gemma3", "idefics3"])
def test_an_abort_stops_an_images_tower_between_its_encoder_layers(kind: TinyVlmKind) -> None:
    from runtime.backends.contract import PrefillInterrupted
    from runtime.backends.vision.tower import encoders

    backend = MlxBackend.load(spec(kind))
    reference = MlxBackend.load(spec(kind))
    try:
        original = (ask("Look.", image_bytes(11)),)
        messages = backend.prepare_media(original)
        prepared = prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048)
        store = backend._media.store  # type: ignore[union-attr]
        (key,) = {split_media(t)[0] for t in prepared.tokens if is_media(t)}
        (encoder,) = encoders(store._model)
        layers = list(encoder["layers"])
        assert len(layers) == 2  # the tiny tower: a check before each layer
        # Check 1 is encode's, before the image; 2 and 3 the layers'. Set at the second layer:
        stop = TripsAt(3)
        with pytest.raises(PrefillInterrupted, match="inside an image's encoding"):
            store.encode(prepared.tokens, stop)
        assert stop.checks == 3  # the first layer ran, the second never started
        assert store._items[key].features is None and store._items[key].inputs  # pixels kept
        assert encoder["layers"] == layers  # the model's own layers are back
        # Never set: the same features as an encoding with no stop flag at all.
        store.encode(prepared.tokens, threading.Event())
        other = reference._media.store  # type: ignore[union-attr]
        reference.prepare_media(original)
        other.encode(prepared.tokens, None)
        assert mx.array_equal(store.features(key), other.features(key))
    finally:
        backend.close()
        reference.close()
