"""``image_url`` parts over HTTP on tiny VLMs: data URLs, allowed local files, refusals (400s
with stable codes naming the part). docs/http.md (images), docs/models.md (vision)."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image

from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, ImagePart, ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.server.media import FETCH_MAX_BYTES
from runtime.testing.tiny_models import tiny_model_path
from runtime.testing.tiny_vlms import tiny_vlm_path
from tests.loop_checks import LoopBackend, on_uvloop
from tests.loopback_files import loopback_files

pytestmark = [pytest.mark.anyio, pytest.mark.mlx]


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


def png(seed: int) -> bytes:
    pixels = (np.random.RandomState(seed).rand(40, 50, 3) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def body(model: str, url: str) -> dict[str, Any]:
    parts = [
        {"type": "text", "text": "What is in"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
        {"type": "text", "text": "this picture?"},
    ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 6,
        "temperature": 0,
    }


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    specs = (
        ModelSpec(name="gemma3", path=str(tiny_vlm_path("gemma3")), backend="mlx"),
        ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx"),
    )
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    config = ServerConfig(
        models=specs, runtime=RuntimeConfig(kv_budget_bytes=1 << 28), media_dirs=(str(allowed),)
    )
    server = OpenAIServer(config)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http, server


async def test_a_data_url_image_answers_as_the_embedded_api_does(
    client: tuple[httpx.AsyncClient, OpenAIServer],
) -> None:
    http, server = client
    response = await http.post("/v1/chat/completions", json=body("gemma3", data_url(png(1))))
    assert response.status_code == 200, response.text
    reply = response.json()
    message = ChatMessage(
        role="user", content="What is in<|image|>this picture?", images=(ImagePart(data=png(1)),)
    )
    reference = await server.runtime.complete("gemma3", messages=[message], max_tokens=6)
    assert reply["choices"][0]["message"]["content"] == reference.text
    assert reply["usage"]["prompt_tokens"] == reference.started.prompt_tokens  # type: ignore[union-attr]


async def test_an_allowed_local_file_is_the_same_image_as_its_data_url(
    client: tuple[httpx.AsyncClient, OpenAIServer], tmp_path: Path
) -> None:
    http, _ = client
    path = tmp_path / "allowed" / "picture.png"
    path.write_bytes(png(2))
    by_data = await http.post("/v1/chat/completions", json=body("gemma3", data_url(png(2))))
    by_file = await http.post("/v1/chat/completions", json=body("gemma3", path.as_uri()))
    assert by_file.status_code == 200, by_file.text
    assert by_file.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("https://example.com/cat.png", "media_source_refused"),
        ("file:///etc/passwd", "media_source_refused"),
        ("OUTSIDE", "media_source_refused"),
        ("CLIMB", "media_source_refused"),
        ("data:image/png;base64,@@not-base64@@", "invalid_media"),
        ("data:text/plain;base64,aGVsbG8=", "invalid_media"),
        (data_url(b"these bytes are no image"), "invalid_media"),
        ("ftp://example.com/cat.png", "invalid_media"),
    ],
    ids=["remote", "system-file", "outside", "dotdot", "bad-b64", "not-image", "garbage", "ftp"],
)
async def test_refused_image_urls_are_400s_naming_the_part(
    client: tuple[httpx.AsyncClient, OpenAIServer], tmp_path: Path, url: str, code: str
) -> None:
    http, _ = client
    outside = tmp_path / "outside.png"
    outside.write_bytes(png(3))
    url = {
        "OUTSIDE": outside.as_uri(),
        "CLIMB": f"file://{tmp_path}/allowed/../outside.png",
    }.get(url, url)
    response = await http.post("/v1/chat/completions", json=body("gemma3", url))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert "messages[0].content[1]" in error["message"]
    good = await http.post("/v1/chat/completions", json=body("gemma3", data_url(png(1))))
    assert good.status_code == 200


async def test_an_image_for_a_text_only_model_is_a_400(
    client: tuple[httpx.AsyncClient, OpenAIServer],
) -> None:
    http, _ = client
    response = await http.post("/v1/chat/completions", json=body("llama", data_url(png(1))))
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "media_unsupported"


@pytest.fixture
def image_host() -> Iterator[str]:
    """A loopback HTTP server: ``/cat.png`` an image, ``/huge`` past the fetch limit,
    ``/slow`` an answer that never comes in time, anything else 404."""
    release = threading.Event()

    def hold(path: str) -> None:
        if path == "/slow":
            release.wait(10)

    routes = {"/cat.png": png(5), "/huge": b"\0" * (FETCH_MAX_BYTES + 10)}
    with loopback_files(routes, hold=hold) as url:
        try:
            yield url
        finally:
            release.set()  # before the server stops: its handler thread is waiting


async def test_a_host_that_enables_fetching_reads_remote_images_within_limits(
    image_host: str,
) -> None:
    spec = ModelSpec(name="gemma3", path=str(tiny_vlm_path("gemma3")), backend="mlx")
    config = ServerConfig(
        models=(spec,),
        runtime=RuntimeConfig(kv_budget_bytes=1 << 28),
        fetch_images=True,
        fetch_timeout_s=1.0,
    )
    server = OpenAIServer(config)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            fetched = await http.post(
                "/v1/chat/completions", json=body("gemma3", f"{image_host}/cat.png")
            )
            inline = await http.post("/v1/chat/completions", json=body("gemma3", data_url(png(5))))
            assert fetched.status_code == 200, fetched.text
            assert fetched.json()["choices"] == inline.json()["choices"]
            for path, words in (("/huge", "bytes"), ("/slow", "within 1 s"), ("/nope", "404")):
                refused = await http.post(
                    "/v1/chat/completions", json=body("gemma3", f"{image_host}{path}")
                )
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["code"] == "media_source_refused"
                assert "messages[0].content[1]" in error["message"] and words in error["message"]
