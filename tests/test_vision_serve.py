"""The official ``openai`` client sends image parts to a real ``mlxrt serve`` process serving a
tiny VLM directory (a data URL, and a file under ``--media-dir``); a refused source is a 400."""

from __future__ import annotations

import base64
import io
from pathlib import Path

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
