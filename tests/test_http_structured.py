"""Structured output over HTTP on a real (tiny) MLX model: ``response_format`` and llama-server's
``json_schema`` / ``grammar`` fields constrain the answer; bad schemas are typed 400s."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest

from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.constraints import live_matchers
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "n"],
    "additionalProperties": False,
}
CHAT = {
    "model": "llama",
    "messages": [{"role": "user", "content": "Name a colour."}],
    "max_tokens": 60,
    "temperature": 0,
}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    server = OpenAIServer(
        ServerConfig(models=(spec,), runtime=RuntimeConfig(kv_budget_bytes=1 << 28))
    )
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            yield http


async def chat(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={**CHAT, **fields})


async def test_response_format_json_schema_constrains_the_answer(
    client: httpx.AsyncClient,
) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    response = await chat(client, response_format=response_format)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    assert live_matchers() == 0


async def test_json_object_mode_and_llama_server_fields(client: httpx.AsyncClient) -> None:
    answer = await chat(client, response_format={"type": "json_object"}, max_tokens=300)
    content = answer.json()["choices"][0]["message"]["content"]
    assert content.startswith("{")
    if answer.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    completion = await client.post(
        "/v1/completions",
        json={
            "model": "llama",
            "prompt": "Pick:",
            "max_tokens": 20,
            "grammar": 'root ::= "a" | "bb"',
        },
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] in ("a", "bb")
    schema = await client.post(
        "/v1/completions",
        json={"model": "llama", "prompt": "n:", "max_tokens": 20, "json_schema": SCHEMA},
    )
    jsonschema.validate(json.loads(schema.json()["choices"][0]["text"]), SCHEMA)
    regex = await client.post(
        "/v1/completions",
        json={"model": "llama", "prompt": "id:", "max_tokens": 20, "regex": "[0-9]{4}"},
    )
    assert re.fullmatch("[0-9]{4}", regex.json()["choices"][0]["text"])


@pytest.mark.parametrize(
    ("fields", "status", "code", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            },
            400,
            "invalid_schema",
            "Invalid type: strin",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
            "invalid_request",
            "needs",
        ),
        (
            {"response_format": {"type": "json_object"}, "regex": "a"},
            400,
            "invalid_request",
            "at most one",
        ),
        ({"regex": "a(b"}, 400, "invalid_grammar", "unclosed group"),
        ({"grammar": "root ::= undefined_rule"}, 400, "invalid_grammar", "undefined_rule"),
    ],
)
async def test_bad_structured_output_requests_are_typed_400s(
    client: httpx.AsyncClient, fields: dict[str, Any], status: int, code: str, words: str
) -> None:
    response = await chat(client, **fields)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and words in error["message"]
