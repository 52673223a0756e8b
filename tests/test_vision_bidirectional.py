"""Bidirectional attention inside image spans where the model's reference declares it (Gemma 3),
causal elsewhere (Idefics3 / SmolVLM): runtime/backends/vision/bidirectional.py, docs/models.md.

The reference is a single forward pass of mlx-vlm's own model over the whole prompt, its image
features from mlx-vlm's ``get_input_embeddings`` on the processor's pixels, with the mask built
here by hand as Hugging Face's Gemma 3 builds it: causal, or both tokens in one run of image soft
tokens. These prompts are within the tiny Gemma 3's sliding window (64), so one mask serves both
kinds of layer.
"""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from actors.engine.checkpoints import CheckpointRule, plan_checkpoints
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.vision.media import inside_span, is_media, past_span
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, ChatOptions, Finished, ModelSpec
from runtime.testing.tiny_vlms import TinyVlmKind, tiny_vlm_path
from runtime.text.chat import prepare_chat
from tests.loop_checks import LoopBackend, on_uvloop
from tests.test_vision import ask, image_bytes, spec

pytestmark = [pytest.mark.mlx]


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    return on_uvloop()


def prompt(backend: MlxBackend, *images: bytes) -> list[int]:
    text = "".join("<|image|>" for _ in images) + "?"
    messages = backend.prepare_media((ask(text, *images),))
    return prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048).tokens


def reference(
    backend: MlxBackend, tokens: list[int], images: list[bytes], both_ways: bool
) -> mx.array:
    """The last logits of mlx-vlm's model over ``tokens`` in one pass: image soft tokens
    attending both ways within each image's run (``both_ways``) or causally."""
    store = backend._media.store  # type: ignore[union-attr]
    vlm = backend._model.vlm
    raw = mx.array([[store.image_token if is_media(t) else t for t in tokens]])
    # Each image's features from mlx-vlm's own embedding of its processor's pixels, one image
    # a call (its Gemma 3 gives other features to two images embedded in one call).
    embeds = vlm.get_input_embeddings(raw, None).inputs_embeds
    media = np.array([is_media(t) for t in tokens])
    positions = iter(np.flatnonzero(media).tolist())  # the images' soft tokens, in order
    for data in images:
        out = store._processor(
            text=[store.marker],
            images=[Image.open(io.BytesIO(data)).convert("RGB")],
            return_tensors="np",
        )
        inputs = {
            k: mx.array(np.asarray(v))
            for k, v in out.items()
            if k not in ("input_ids", "attention_mask", "token_type_ids")
        }
        ids = mx.array(np.asarray(out["input_ids"]))
        pixels = inputs.pop("pixel_values")
        one = vlm.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape), **inputs)
        soft = np.flatnonzero(np.asarray(out["input_ids"])[0] == store.image_token)
        rows = one.inputs_embeds[0][mx.array(soft)].astype(embeds.dtype)
        for k in range(len(soft)):
            embeds[0, next(positions)] = rows[k]
    assert next(positions, None) is None
    n = len(tokens)
    window = getattr(getattr(vlm.language_model, "model", None), "window_size", None)
    assert window is None or n <= window  # one mask serves both kinds of layer
    mask = np.tril(np.ones((n, n), dtype=bool))
    if both_ways:  # Hugging Face's blocks: each maximal run of image soft tokens
        block = np.cumsum(media & ~np.concatenate([[False], media[:-1]])) * media
        mask |= (block[:, None] == block[None, :]) & media[:, None]
    logits = vlm.language_model(raw, inputs_embeds=embeds, mask=mx.array(mask)).logits
    return logits[0, -1].astype(mx.float32)


def gap(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max().item())


@pytest.fixture(scope="module")
def gemma() -> MlxBackend:
    backend = MlxBackend.load(spec("gemma3"))
    yield backend
    backend.close()


def test_gemma3_image_spans_attend_both_ways_as_its_reference(gemma: MlxBackend) -> None:
    images = [image_bytes(1), image_bytes(2)]
    tokens = prompt(gemma, *images)
    state = gemma.new_state()
    gemma.prefill(state, tokens)
    ours = gemma.logits(state)
    assert gap(ours, reference(gemma, tokens, images, both_ways=True)) < 1e-4
    # The test can fail: a causal pass (mlx-vlm's own generation) gives other logits.
    assert gap(ours, reference(gemma, tokens, images, both_ways=False)) > 1e-2


def test_chunks_shorter_than_an_image_never_split_its_span(gemma: MlxBackend) -> None:
    images = [image_bytes(3)]
    tokens = prompt(gemma, *images)
    soft = [i for i, t in enumerate(tokens) if is_media(t)]
    assert len(soft) == 16
    state = gemma.new_state()
    start = 0
    while start < len(tokens):  # 4-token chunks, each ended as the engine ends them
        end = min(past_span(tokens, start + 4), len(tokens))
        assert not inside_span(tokens, end)
        gemma.prefill(state, tokens[start:end], logits=end == len(tokens))
        start = end
    assert gap(gemma.logits(state), reference(gemma, tokens, images, both_ways=True)) < 1e-4


def test_the_backend_refuses_a_pass_cut_inside_a_span(gemma: MlxBackend) -> None:
    tokens = prompt(gemma, image_bytes(4))
    inside = next(i for i, t in enumerate(tokens) if is_media(t)) + 5
    assert inside_span(tokens, inside)
    states = [gemma.new_state(), gemma.new_state()]
    with pytest.raises(ValueError, match="inside an image's soft tokens"):
        gemma.prefill_together(states, [tokens, tokens], [[inside], []])
    assert all(s.length == 0 for s in states)


def test_checkpoints_are_never_planned_inside_a_span(gemma: MlxBackend) -> None:
    tokens = prompt(gemma, image_bytes(5), image_bytes(6))
    every = CheckpointRule(spacing=1, most=len(tokens))  # a point at every token but the spans'
    points = plan_checkpoints(tokens, 0, len(tokens), gemma.decode, every)
    assert not any(inside_span(tokens, p) for p in points)
    assert len(points) == len(tokens) - 2 * 15  # the end too; none of the 15 inside each run


def test_prompts_prefilled_together_equal_each_alone(gemma: MlxBackend) -> None:
    chats = [[image_bytes(7)], [image_bytes(8), image_bytes(9)]]
    prompts = [prompt(gemma, *images) for images in chats]
    states = [gemma.new_state() for _ in prompts]
    gemma.prefill_together(states, prompts)
    for state, tokens, images in zip(states, prompts, chats, strict=True):
        alone = reference(gemma, tokens, images, both_ways=True)
        assert gap(gemma.logits(state), alone) < 1e-4


@pytest.mark.parametrize("kind", ["idefics3"])
def test_families_that_do_not_declare_it_stay_causal(kind: TinyVlmKind) -> None:
    backend = MlxBackend.load(spec(kind))
    try:
        assert not backend._model.bidirectional_spans
        images = [image_bytes(1)]
        tokens = prompt(backend, *images)
        state = backend.new_state()
        backend.prefill(state, tokens)
        ours = backend.logits(state)
        assert gap(ours, reference(backend, tokens, images, both_ways=False)) < 1e-4
        assert gap(ours, reference(backend, tokens, images, both_ways=True)) > 1e-2
    finally:
        backend.close()


@pytest.mark.anyio
async def test_small_chunks_and_turn_two_reuse_equal_one_cold_pass() -> None:
    chunked = ModelSpec(
        name="small", path=str(tiny_vlm_path("gemma3")), backend="mlx", prefill_chunk_tokens=4
    )
    turn1 = [ask("Describe this picture.", image_bytes(10))]
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec("gemma3"))
        await rt.load_model(chunked)
        whole = await rt.complete("gemma3", messages=turn1, max_tokens=6)
        small = await rt.complete("small", messages=turn1, max_tokens=6)
        assert isinstance(whole.terminal, Finished) and isinstance(small.terminal, Finished)
        assert small.token_ids == whole.token_ids
        turn2 = [
            *turn1,
            ChatMessage(role="assistant", content=whole.text),
            ChatMessage(role="user", content="And its colours?"),
        ]
        warm = await rt.complete("small", messages=turn2, max_tokens=6)
        assert warm.started is not None and warm.started.cached_tokens > 16
        await rt.reset("gemma3")
        cold = await rt.complete("gemma3", messages=turn2, max_tokens=6)
        assert cold.started is not None and cold.started.cached_tokens == 0
        assert warm.token_ids == cold.token_ids


def test_where_a_pass_may_end_around_runs_of_media_tokens() -> None:
    from runtime.backends.vision.media import longest_run, media_ids

    tokens = [5, 6, *media_ids(1, 4), 7, *media_ids(2, 3), *media_ids(3, 2), 8]
    assert [p for p in range(len(tokens) + 1) if inside_span(tokens, p)] == [3, 4, 5, 8, 9, 10, 11]
    assert past_span(tokens, 3) == 6 and past_span(tokens, 6) == 6 and past_span(tokens, 9) == 12
    assert longest_run(tokens) == 5 and longest_run([1, 2, 3]) == 0 and longest_run([]) == 0
