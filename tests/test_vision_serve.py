"""The official ``openai`` client sends image parts to a real ``mlxrt serve`` process serving a
tiny VLM directory (a data URL, and a file under ``--media-dir``); a refused source is a 400;
a video part (vLLM's ``video_url``) to a video-capable one."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from runtime.testing.tiny_vlms import tiny_vlm_path
from tests.test_serve_process import client_for, mlxrt_serve

pytestmark = pytest.mark.mlx


def png(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(40, 50, 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def ask(client: openai.OpenAI, url: str) -> str:
    reply = client.chat.completions.create(
        model="vlm",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=5,
        temperature=0,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens > 16  # the soft tokens count
    return reply.choices[0].message.content or ""


def test_the_openai_client_sends_image_parts_to_mlxrt_serve(tmp_path: Path) -> None:
    model = tiny_vlm_path("gemma3")
    picture = tmp_path / "picture.png"
    picture.write_bytes(png(1))
    with (
        mlxrt_serve(
            "--backend", "mlx", "--model", f"vlm={model}", "--media-dir", str(tmp_path)
        ) as url,
        client_for(url) as client,
    ):  # closed: no socket left for the collector
        by_data = ask(client, f"data:image/png;base64,{base64.b64encode(png(1)).decode()}")
        assert by_data == ask(client, picture.as_uri())
        with pytest.raises(openai.BadRequestError) as refused:
            ask(client, "https://example.com/cat.png")
        assert refused.value.code == "media_source_refused"


def test_the_openai_client_sends_a_video_part_to_mlxrt_serve(tmp_path: Path) -> None:
    import cv2

    path = tmp_path / "clip.avi"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (40, 24))
    rng = np.random.RandomState(0)
    for _ in range(8):  # 2 s: two frames sampled at 1 a second
        writer.write((rng.rand(24, 40, 3) * 255).astype(np.uint8))
    writer.release()
    data = f"data:video/x-msvideo;base64,{base64.b64encode(path.read_bytes()).decode()}"
    model = tiny_vlm_path("smolvlm")
    with (
        mlxrt_serve("--backend", "mlx", "--model", f"vlm={model}") as url,
        client_for(url) as client,
    ):
        # vLLM's part; the openai types do not name it, so it goes as a plain dict.
        part: Any = {"type": "video_url", "video_url": {"url": data}}
        reply = client.chat.completions.create(
            model="vlm",
            messages=[{"role": "user", "content": [{"type": "text", "text": "What?"}, part]}],
            max_tokens=5,
            temperature=0,
        )
        assert reply.usage is not None and reply.usage.prompt_tokens > 2 * 7  # the frames count
        assert reply.choices[0].finish_reason in ("stop", "length")
