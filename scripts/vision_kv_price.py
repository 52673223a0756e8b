"""How close the KV price of an image or video prompt is to the cache it really fills, per tiny VLM.

For each tiny VLM family and 1 or 4 images, and for the video-capable one (SmolVLM2) a video of 3
sampled frames and one of 8 frames sent directly: the prompt's tokens and soft tokens, the price
the engine reserves (``ModelInfo.kv_bytes``) and the bytes of the cache's arrays after the prefill.
Not a test (tests/test_vision.py holds each within 10%); the figures go into docs/models.md.

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/vision_kv_price.py
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.vision.media import is_media
from runtime.messages import ChatMessage, ChatOptions, ImagePart, ModelSpec, VideoPart
from runtime.testing.tiny_vlms import TINY_VLM_KINDS, tiny_vlm_path
from runtime.text.chat import prepare_chat


def png(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(40, 50, 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def avi(frames: int) -> bytes:
    """A 4-frames-a-second random AVI written by OpenCV (sampled at 1 a second)."""
    import tempfile
    from pathlib import Path

    import cv2

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.avi"
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (40, 24))
        rng = np.random.RandomState(frames)
        for _ in range(frames):
            writer.write((rng.rand(24, 40, 3) * 255).astype(np.uint8))
        writer.release()
        return path.read_bytes()


def measure(backend: MlxBackend, what: str, message: ChatMessage) -> None:
    messages = backend.prepare_media((message,))
    prepared = prepare_chat(backend.chat_tokenizer, messages, ChatOptions(), 8, 2048)
    state = backend.new_state()
    backend.prefill(state, prepared.tokens)
    real = backend.state_nbytes(state)
    priced = backend.info.kv_bytes(len(prepared.tokens))
    soft = sum(1 for t in prepared.tokens if is_media(t))
    print(
        f"{what}, {len(prepared.tokens)} tokens ({soft} soft), "
        f"priced {priced} B, real {real} B, {priced / real:.3f}x"
    )


def main() -> None:
    for kind in TINY_VLM_KINDS:
        backend = MlxBackend.load(ModelSpec(name=kind, path=str(tiny_vlm_path(kind))))
        for count in (1, 4):
            images = tuple(ImagePart(data=png(i)) for i in range(count))
            message = ChatMessage(role="user", content="Compare these.", images=images)
            measure(backend, f"{kind}: {count} image(s)", message)
        if kind == "smolvlm":
            file = VideoPart(data=avi(12))  # 3 s: 3 frames sampled
            frames = VideoPart(frames=tuple(png(i) for i in range(8)))
            for what, video in (("video, 3 sampled frames", file), ("video, 8 frames", frames)):
                message = ChatMessage(role="user", content="What happens?", videos=(video,))
                measure(backend, f"{kind}: {what}", message)
        backend.close()


if __name__ == "__main__":
    main()
