"""Video in the prompt: a tiny random-weight SmolVLM2-layout model (runtime/testing/tiny_vlms.py,
``smolvlm``) takes a video file or its frames; frames are sampled with a cap, each priced and keyed
on its pixels like an image. Bad videos and videos to families without video are typed 400s.
docs/models.md (video), docs/http.md (``video_url``).
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
pytest.importorskip("cv2")

import cv2
from PIL import Image

from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.vision.media import is_media
from runtime.errors import error_for_code
from runtime.host.api import Completion, Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    ChatMessage,
    ChatOptions,
    Failed,
    Finished,
    ModelSpec,
    ReusePath,
    VideoPart,
)
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.tiny_models import tiny_model_path
from runtime.testing.tiny_vlms import TinyVlmKind, tiny_vlm_path
from runtime.text.chat import prepare_chat
from tests.loopback_files import loopback_files

pytestmark = [pytest.mark.anyio, pytest.mark.mlx]
# The tiny SmolVLM2 samples 1 frame a second (at most 8); each frame is one 32 x 32 tile: 4 soft
# tokens between <fake_token_around_image><global-img> and <fake_token_around_image>.
PER_FRAME = 4
FRAMES = 12  # frames written at 4 a second: a 3 s video, sampled to 3 frames


def video_file(path: Path, seed: int, fourcc: str = "MJPG", frames: int = FRAMES) -> bytes:
    """A small random video written by OpenCV (``MJPG`` in AVI, ``mp4v`` in MP4)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), 4.0, (40, 24))
    assert writer.isOpened()
    rng = np.random.RandomState(seed)
    for _ in range(frames):
        writer.write((rng.rand(24, 40, 3) * 255).astype(np.uint8))
    writer.release()
    return path.read_bytes()


@pytest.fixture
def clip(tmp_path: Path) -> bytes:
    return video_file(tmp_path / "clip.avi", 1)


def spec(kind: TinyVlmKind = "smolvlm", **options: Any) -> ModelSpec:
    return ModelSpec(name=kind, path=str(tiny_vlm_path(kind)), backend="mlx", options=options)


def watch(text: str, *videos: VideoPart) -> ChatMessage:
    return ChatMessage(role="user", content=text, videos=videos)


async def greedy(rt: Runtime, model: str, messages: list[ChatMessage]) -> Completion:
    done = await rt.complete(model, messages=messages, max_tokens=6)
    assert isinstance(done.terminal, Finished), done.terminal
    return done


def failure(done: Completion) -> Failed:
    assert isinstance(done.terminal, Failed), done.terminal
    return done.terminal


@pytest.fixture
async def smolvlm() -> AsyncIterator[Runtime]:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec())
        yield rt


def test_a_video_becomes_timestamped_frames_priced_as_the_cache_they_fill(clip: bytes) -> None:
    backend = MlxBackend.load(spec())
    try:
        messages = (watch("What happens in <|video|>?", VideoPart(data=clip)),)
        prepared = prepare_chat(
            backend.chat_tokenizer, backend.prepare_media(messages), ChatOptions(), 8, 4096
        )
        assert "series of 3 frames from a 0:00:03 [H:MM:SS] video" in prepared.text
        assert prepared.text.count("Frame from 00:0") == 3
        soft = [t for t in prepared.tokens if is_media(t)]
        assert len(soft) == 3 * PER_FRAME  # the processor's own count for the sampled frames
        state = backend.new_state()
        backend.prefill(state, prepared.tokens)
        real = backend.state_nbytes(state)
        priced = backend.info.kv_bytes(len(prepared.tokens))
        assert real <= priced <= 1.1 * real
    finally:
        backend.close()


def test_frames_are_capped_by_the_option_and_sent_frames_match_the_file(
    clip: bytes, tmp_path: Path
) -> None:
    backend = MlxBackend.load(spec(max_video_frames=2))
    try:
        two = backend.prepare_media((watch("", VideoPart(data=clip)),))
        assert "series of 2 frames" in two[0].content
        # The same pixels sent as frames (lossless PNGs of the decoded frames) are the same keys.
        capture = cv2.VideoCapture(str(tmp_path / "clip.avi"))
        pngs = []
        for index in (0, FRAMES - 1):
            capture.set(cv2.CAP_PROP_POS_FRAMES, index)
            ok, frame = capture.read()
            assert ok
            out = io.BytesIO()
            Image.fromarray(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB)).save(out, format="PNG")
            pngs.append(out.getvalue())
        capture.release()
        sent = backend.prepare_media((watch("", VideoPart(frames=tuple(pngs), fps=4 / 11)),))
        keys = re.findall(r"mlxrt-image:([0-9a-f]{12})", two[0].content)
        assert len(keys) == 2
        assert keys == re.findall(r"mlxrt-image:([0-9a-f]{12})", sent[0].content)
    finally:
        backend.close()


async def test_the_same_video_in_turn_two_reuses_its_kv_and_equals_cold(
    smolvlm: Runtime, clip: bytes
) -> None:
    turn1 = [watch("Describe this video.", VideoPart(data=clip))]
    first = await greedy(smolvlm, "smolvlm", turn1)
    turn2 = [
        *turn1,
        ChatMessage(role="assistant", content=first.text),
        ChatMessage(role="user", content="And then?"),
    ]
    warm = await greedy(smolvlm, "smolvlm", turn2)
    assert warm.started is not None and warm.started.path is not ReusePath.MISS
    assert warm.started.cached_tokens > 3 * PER_FRAME  # every frame's span came from cache
    await smolvlm.reset("smolvlm")
    cold = await greedy(smolvlm, "smolvlm", turn2)
    assert cold.started is not None and cold.started.cached_tokens == 0
    assert warm.token_ids == cold.token_ids


async def test_a_different_video_at_the_same_position_never_reuses_past_it(
    smolvlm: Runtime, clip: bytes, tmp_path: Path
) -> None:
    other_clip = video_file(tmp_path / "other.avi", 2)
    await greedy(smolvlm, "smolvlm", [watch("Describe this video.", VideoPart(data=clip))])
    other = await greedy(
        smolvlm, "smolvlm", [watch("Describe this video.", VideoPart(data=other_clip))]
    )
    assert other.started is not None
    backend = MlxBackend.load(spec())
    try:
        messages = backend.prepare_media(
            (watch("Describe this video.", VideoPart(data=other_clip)),)
        )
        tokens = prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 4096).tokens
        first_soft = next(i for i, t in enumerate(tokens) if is_media(t))
    finally:
        backend.close()
    assert 0 < other.started.cached_tokens <= first_soft
    await smolvlm.reset("smolvlm")
    cold = await greedy(
        smolvlm, "smolvlm", [watch("Describe this video.", VideoPart(data=other_clip))]
    )
    assert other.token_ids == cold.token_ids


async def test_an_mp4_file_read_from_a_path_is_served(smolvlm: Runtime, tmp_path: Path) -> None:
    video_file(tmp_path / "clip.mp4", 3, fourcc="mp4v")
    part = VideoPart.from_file(str(tmp_path / "clip.mp4"))
    done = await greedy(smolvlm, "smolvlm", [watch("What is this?", part)])
    assert done.started is not None and done.started.prompt_tokens > 3 * PER_FRAME


@pytest.mark.parametrize(
    ("video", "code", "names"),
    [
        (VideoPart(data=b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64), "invalid_media", "decoded"),
        (VideoPart(data=b"GIF89a" + b"\x00" * 64), "invalid_media", "container"),
        ("LONG", "invalid_media", "max_video_seconds"),
        ("FRAMES", "too_many_frames", "3 frames"),
        (VideoPart(data=b""), "invalid_media", "empty"),
        (VideoPart(frames=(b"not a png",)), "invalid_media", "videos[0].frames[0]"),
        ("ZERO-FPS", "invalid_media", "fps"),
    ],
    ids=[
        "undecodable",
        "unsupported-container",
        "too-long",
        "too-many-frames",
        "empty",
        "bad-frame",
        "zero-fps",
    ],
)
async def test_bad_videos_are_typed_errors_naming_the_part_and_spare_the_rest(
    video: VideoPart | str, code: str, names: str, tmp_path: Path, clip: bytes
) -> None:
    if video == "LONG":  # 12 s at 1 frame a second, past a 10 s limit
        video = VideoPart(data=video_file(tmp_path / "long.avi", 4, frames=48))
    elif video in ("FRAMES", "ZERO-FPS"):
        png = io.BytesIO()
        Image.new("RGB", (8, 8)).save(png, format="PNG")
        count, fps = (3, 1.0) if video == "FRAMES" else (1, 0.0)
        video = VideoPart(frames=(png.getvalue(),) * count, fps=fps)
    assert isinstance(video, VideoPart)
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(max_video_frames=2, max_video_seconds=10))
        # A request already running when the bad one arrives finishes as it would have.
        import anyio

        async with anyio.create_task_group() as tg:
            done: list[Completion] = []

            async def good() -> None:
                done.append(await greedy(rt, "smolvlm", [watch("Look.", VideoPart(data=clip))]))

            tg.start_soon(good)
            bad = failure(
                await rt.complete("smolvlm", messages=[watch("Look.", video)], max_tokens=4)
            )
        assert bad.code == code and names in bad.message, bad.message
        assert "messages[0].videos[0]" in bad.message
        assert error_for_code(bad.code, bad.message).code == code
        assert done[0].started is not None


@pytest.mark.parametrize("model", ["gemma3", "llama"])
async def test_a_video_to_a_model_without_video_is_refused(model: str, clip: bytes) -> None:
    path = tiny_vlm_path("gemma3") if model == "gemma3" else tiny_model_path("llama")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(ModelSpec(name=model, path=str(path), backend="mlx"))
        bad = failure(await rt.complete(model, messages=[watch("Look.", VideoPart(data=clip))]))
        assert bad.code == "media_unsupported" and "messages[0]" in bad.message


async def test_a_video_the_kv_budget_cannot_hold_is_refused_at_once() -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(png, format="PNG")
    many = VideoPart(frames=(png.getvalue(),) * 40)  # 40 frames of 7 tokens: over 256
    backend = MlxBackend.load(spec(max_video_frames=64))
    per_token = backend.info.kv_bytes(256) // 256  # the budget is priced in 256-token blocks
    backend.close()
    # Room for a short text prompt and its reply, not for the video's frames.
    async with Runtime(RuntimeConfig(kv_budget_bytes=per_token * 256)) as rt:
        await rt.load_model(spec(max_video_frames=64))
        text = await greedy(rt, "smolvlm", [ChatMessage(role="user", content="Hi")])
        assert text.started is not None
        bad = failure(await rt.complete("smolvlm", messages=[watch("See.", many)], max_tokens=4))
        assert bad.code == "kv_request_too_large"
        assert bad.usage is not None and bad.usage.prompt_tokens > 40 * 7


def video_body(model: str, url: str) -> dict[str, Any]:
    parts = [
        {"type": "text", "text": "What happens in"},
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "this video?"},
    ]
    messages = [{"role": "user", "content": parts}]
    return {"model": model, "messages": messages, "max_tokens": 6, "temperature": 0}


async def test_video_url_parts_over_http(clip: bytes, tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "clip.avi").write_bytes(clip)
    config = ServerConfig(
        models=(spec(),), runtime=RuntimeConfig(kv_budget_bytes=1 << 28), media_dirs=(str(allowed),)
    )
    server = OpenAIServer(config)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            data = f"data:video/x-msvideo;base64,{base64.b64encode(clip).decode()}"
            by_data = await http.post("/v1/chat/completions", json=video_body("smolvlm", data))
            assert by_data.status_code == 200, by_data.text
            message = watch("What happens in<|video|>this video?", VideoPart(data=clip))
            reference = await server.runtime.complete("smolvlm", messages=[message], max_tokens=6)
            assert by_data.json()["choices"][0]["message"]["content"] == reference.text
            by_file = await http.post(
                "/v1/chat/completions",
                json=video_body("smolvlm", (allowed / "clip.avi").as_uri()),
            )
            assert by_file.json()["choices"] == by_data.json()["choices"]
            for url, code in (
                ("https://example.com/clip.mp4", "media_source_refused"),
                ("file:///etc/passwd", "media_source_refused"),
                ("data:image/png;base64,aGVsbG8=", "invalid_media"),
                (f"data:video/mp4;base64,{base64.b64encode(b'GIF89a').decode()}", "invalid_media"),
            ):
                refused = await http.post("/v1/chat/completions", json=video_body("smolvlm", url))
                assert refused.status_code == 400, (url, refused.text)
                error = refused.json()["error"]
                assert error["code"] == code and "messages[0].content[1]" in error["message"]


@pytest.fixture
def video_host(clip: bytes) -> Iterator[str]:
    """A loopback HTTP server: ``/clip.avi`` the clip, anything else 404."""
    with loopback_files({"/clip.avi": clip}) as url:
        yield url


async def test_a_host_that_enables_fetching_reads_remote_videos(
    clip: bytes, video_host: str
) -> None:
    config = ServerConfig(
        models=(spec(),),
        runtime=RuntimeConfig(kv_budget_bytes=1 << 28),
        fetch_images=True,
        fetch_timeout_s=5.0,
    )
    server = OpenAIServer(config)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            data = f"data:video/x-msvideo;base64,{base64.b64encode(clip).decode()}"
            inline = await http.post("/v1/chat/completions", json=video_body("smolvlm", data))
            url = f"{video_host}/clip.avi"
            fetched = await http.post("/v1/chat/completions", json=video_body("smolvlm", url))
            assert fetched.status_code == 200, fetched.text
            assert fetched.json()["choices"] == inline.json()["choices"]
            missing = f"{video_host}/nope.mp4"
            refused = await http.post("/v1/chat/completions", json=video_body("smolvlm", missing))
            assert refused.status_code == 400
            error = refused.json()["error"]
            assert error["code"] == "media_source_refused" and "404" in error["message"]
            assert error["param"] == "messages[0].content[1].video_url"


async def test_a_prewarmed_video_chat_is_reused_exactly(smolvlm: Runtime, clip: bytes) -> None:
    chat = [watch("Describe this video.", VideoPart(data=clip))]
    warm = await smolvlm.prewarm("smolvlm", messages=chat)
    assert isinstance(warm, Finished)
    hot = await greedy(smolvlm, "smolvlm", chat)
    assert hot.started is not None and hot.started.path is ReusePath.EXACT
    await smolvlm.reset("smolvlm")
    cold = await greedy(smolvlm, "smolvlm", chat)
    assert hot.token_ids == cold.token_ids


async def test_concurrent_video_streams_equal_each_alone(tmp_path: Path) -> None:
    """Decoded as one batch, each stream's tokens are its own alone. Chunks stay at their cap
    (``prefill_chunk_ms=0``), so each prompt may join a together-prefill whatever this machine's
    speed."""
    import anyio

    # Three videos of other frames and lengths (3, 2 and 4 sampled frames).
    clips = [
        video_file(tmp_path / f"v{seed}.avi", seed, frames=n)
        for seed, n in ((2, 12), (3, 8), (4, 16))
    ]
    chats = [[watch("What happens in <|video|>?", VideoPart(data=c))] for c in clips]
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec(prefill_chunk_ms=0))
        alone = []
        for chat in chats:
            alone.append(await greedy(rt, "smolvlm", chat))
            await rt.reset("smolvlm")
        together: dict[int, Completion] = {}

        async def run(i: int) -> None:
            together[i] = await greedy(rt, "smolvlm", chats[i])

        async with anyio.create_task_group() as tg:
            for i in range(len(chats)):
                tg.start_soon(run, i)
        assert [together[i].token_ids for i in range(len(chats))] == [a.token_ids for a in alone]
        engine = next(s for a, s in rt.stats().actors.items() if a.startswith("engine:smolvlm#"))
        assert engine.counters["batch_steps"] > 0  # they really decoded as one batch
        # Prefilled together or one by one, as the engine's steps fell (the next test holds a
        # prefill of them together to each alone, deterministically).


def test_video_prompts_prefilled_together_equal_each_alone(tmp_path: Path) -> None:
    import mlx.core as mx

    backend = MlxBackend.load(spec())
    try:
        prompts = []
        for seed, n in ((2, 12), (3, 8), (4, 16)):
            part = VideoPart(data=video_file(tmp_path / f"v{seed}.avi", seed, frames=n))
            messages = backend.prepare_media((watch("What happens in <|video|>?", part),))
            prompts.append(
                prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 4096).tokens
            )
        assert len({len(p) for p in prompts}) == 3  # padded rows, each its own length
        states = [backend.new_state() for _ in prompts]
        backend.prefill_together(states, prompts)
        for state, tokens in zip(states, prompts, strict=True):
            alone = backend.new_state()
            backend.prefill(alone, tokens)
            gap = mx.abs(backend.logits(state) - backend.logits(alone)).max().item()
            assert gap < 1e-4
    finally:
        backend.close()
