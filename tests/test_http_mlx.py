"""The HTTP server on a real (tiny) MLX model: a streamed chat completion through its template."""

from __future__ import annotations

import json

import httpx
import pytest

from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.tiny_models import load_tiny_model, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


async def test_a_streamed_chat_on_a_tiny_llama_goes_through_its_chat_template() -> None:
    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    runtime = RuntimeConfig(kv_budget_bytes=1 << 28)
    server = OpenAIServer(ServerConfig(models=(spec,), runtime=runtime))
    body = {
        "model": "llama",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            response = await client.post("/v1/chat/completions", json=body)
        reference = await server.runtime.complete(
            "llama", messages=[ChatMessage(**m) for m in MESSAGES], max_tokens=8
        )
    assert response.status_code == 200
    events = [
        json.loads(block.removeprefix("data: "))
        for block in response.text.split("\n\n")
        if block and block != "data: [DONE]"
    ]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == reference.text and "<|im_start|>" not in text
    usage = events[-1]["usage"]
    _, tokenizer = load_tiny_model("llama")
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert usage["prompt_tokens"] == len(rendered)  # the model's ChatML template, not a fallback
    assert usage["completion_tokens"] == 8
    assert events[-2]["choices"][0]["finish_reason"] == "length"
