"""What other servers' clients send (docs/http.md, runtime/server/compat.py): no ``model``, a
per-request ``keep_alive``, ``typical_p``, ``chat_template_kwargs`` and ``reasoning_effort``,
fields ignored with one log line each, fields still refused, and CORS for browser UIs."""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from mlx_lm.utils import load_tokenizer

from runtime.backends.simulated import greedy_continuation
from runtime.errors import InvalidRequest
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, ChatOptions, ModelSpec
from runtime.server import OpenAIServer, ServerConfig
from runtime.server.schema import ChatCompletionRequest
from runtime.server.translate import chat_call
from runtime.testing.harness import sim_spec, wait_until
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.chat import prepare_chat

pytestmark = pytest.mark.anyio

Json = dict[str, Any]
HI = [{"role": "user", "content": "hi"}]
ORIGIN = "http://localhost:3000"


@contextlib.asynccontextmanager
async def serving(*models: ModelSpec, **server: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with serving_with(*models, **server) as (client, _):
        yield client


@contextlib.asynccontextmanager
async def serving_with(
    *models: ModelSpec, **server: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, OpenAIServer]]:
    config = ServerConfig(
        models=models or (sim_spec("m", chunk=8),),
        runtime=RuntimeConfig(kv_budget_bytes=64 << 20),
        **server,
    )
    served = OpenAIServer(config)
    app = served.app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, served


def expected(prompt: str, n: int) -> str:
    return bytes(greedy_continuation(list(prompt.encode()), n)).decode()


# --------------------------------------------------------------------------- model


async def test_a_request_without_model_gets_the_only_model() -> None:
    async with serving() as client:
        text = await client.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}
        )
        assert text.status_code == 200, text.text
        assert text.json()["model"] == "m"
        assert text.json()["choices"][0]["text"] == expected("hello", 4)
        chat = await client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
        assert (chat.status_code, chat.json()["model"]) == (200, "m")
        prewarm = await client.post("/v1/prewarm", json={"prompt": "hello"})
        assert (prewarm.status_code, prewarm.json()["model"]) == (200, "m")


async def test_without_model_several_models_are_a_400_naming_them() -> None:
    async with serving(sim_spec("a"), sim_spec("b")) as client:
        response = await client.post("/v1/completions", json={"prompt": "hello"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_request", "model")
        assert "2 models (a, b)" in error["message"]


# --------------------------------------------------------------------------- keep_alive


async def keep_alive_of(client: httpx.AsyncClient, model: str = "m") -> object:
    [card] = [c for c in (await client.get("/v1/models")).json()["data"] if c["id"] == model]
    return card["keep_alive"]


async def test_a_request_keep_alive_becomes_the_model_keep_alive() -> None:
    async with serving(keep_alive_s=300.0) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1}
        for keep_alive, shown in (("1h", 3600.0), (-1, None), (90, 90.0)):
            response = await client.post("/v1/completions", json={**body, "keep_alive": keep_alive})
            assert response.status_code == 200, response.text
            assert await keep_alive_of(client) == shown
        bad = await client.post("/v1/completions", json={**body, "keep_alive": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "keep_alive"


async def test_keep_alive_0_unloads_the_model_once_the_request_ends() -> None:
    async with serving_with() as (client, server):
        body = {"model": "m", "prompt": "hi", "max_tokens": 1, "keep_alive": 0}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
        router = server.runtime.stats

        def unloaded() -> bool:
            return router().actors["router"].gauges["models_idle"] == 1

        await wait_until(server.runtime, unloaded, what="the keep-alive's unload")
        states = {c["id"]: c["state"] for c in (await client.get("/v1/models")).json()["data"]}
        assert states["m"] == "idle"
        again = await client.post("/v1/completions", json={**body, "keep_alive": -1})
        assert again.status_code == 200  # loaded again on demand, then kept
        assert await keep_alive_of(client) is None


# --------------------------------------------------------------------------- typical_p


async def test_typical_p_reaches_the_sampler() -> None:
    async with serving() as client:
        body = {"model": "m", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        ok = await client.post("/v1/completions", json={**body, "typical_p": 0.5})
        assert ok.status_code == 200, ok.text
        out_of_range = await client.post("/v1/completions", json={**body, "typical_p": 1.5})
        assert out_of_range.status_code == 400
        assert out_of_range.json()["error"]["param"] == "typical_p"


# --------------------------------------------------------------------------- template variables


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_a_real_template() -> None:
    tokenizer = load_tokenizer(tiny_model_path("llama"))
    tokenizer._tokenizer.chat_template = THINKING_TEMPLATE
    messages = [ChatMessage("user", "hi")]

    def rendered(kwargs: dict[str, object] | None) -> str:
        options = ChatOptions(template_kwargs=None if kwargs is None else json.dumps(kwargs))
        return prepare_chat(tokenizer, messages, options, 8, 4096).text

    # mlx-lm passes enable_thinking itself: the model's own (off for this one) unless given.
    assert rendered(None).endswith("<think>\n\n</think>\n\n")
    assert rendered({"enable_thinking": False}) == rendered(None)
    assert rendered({"enable_thinking": True}).endswith("<|im_start|>assistant\n")
    assert rendered({"reasoning_effort": "low"}).endswith("effort: low\n")


def test_chat_template_kwargs_and_reasoning_effort_become_chat_options() -> None:
    def call(**fields: object) -> ChatOptions:
        body = ChatCompletionRequest(model="m", messages=[], **fields)  # type: ignore[arg-type]
        return chat_call(body).request.chat

    assert call().template_kwargs is None
    options = call(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="high")
    assert json.loads(options.template_kwargs or "") == {
        "enable_thinking": False,
        "reasoning_effort": "high",
    }


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"chat_template_kwargs": {"tools": []}}, "messages", "invalid_request"),
        ({"chat_template_kwargs": {"add_generation_prompt": False}}, "messages", "invalid_request"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_request"),
        (
            {"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
            "reasoning_effort",
            "conflicting_parameters",
        ),
    ],
)
async def test_template_variables_the_server_cannot_honour_are_refused(
    fields: Json, param: str, code: str
) -> None:
    async with serving() as client:
        response = await client.post(
            "/v1/chat/completions", json={"model": "m", "messages": HI, **fields}
        )
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == code
        assert param in (error["param"] or "") or param in error["message"]


async def test_a_tiny_model_chat_accepts_template_variables() -> None:
    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    async with serving(spec) as client:
        body = {"messages": HI, "max_tokens": 2, "temperature": 0}
        plain = await client.post("/v1/chat/completions", json=body)
        with_kwargs = await client.post(
            "/v1/chat/completions",
            json={**body, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert plain.status_code == with_kwargs.status_code == 200
        # The tiny template reads no variable: the same prompt, the same answer.
        assert with_kwargs.json()["choices"] == plain.json()["choices"]


# --------------------------------------------------------------------------- ignored, refused


async def test_harmless_fields_are_ignored_with_one_log_line_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="mlx_actor_runtime.server")
    async with serving() as client:
        body = {"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        extras = {"timings_per_token": True, "n_keep": -1, "return_tokens": True}
        for _ in range(3):
            response = await client.post("/v1/completions", json={**body, **extras})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected("hello", 3)
    notes = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert sorted(note.split()[2].rstrip(";") for note in notes) == sorted(extras)


@pytest.mark.parametrize("field", ["mirostat", "dynatemp_range", "samplers", "role_mapping"])
async def test_fields_that_would_change_the_output_are_still_refused(field: str) -> None:
    async with serving() as client:
        response = await client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", field: 1}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("unsupported_parameter", field)


# --------------------------------------------------------------------------- CORS


async def test_without_allowed_origins_there_is_no_cors() -> None:
    async with serving() as client:
        preflight = await client.options(
            "/v1/chat/completions",
            headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 405
        answer = await client.get("/v1/models", headers={"Origin": ORIGIN})
        assert not any(h.startswith("access-control-") for h in answer.headers)


async def test_allowed_origins_answer_the_preflight_and_label_the_replies() -> None:
    async with serving(allowed_origins=(ORIGIN,)) as client:
        preflight = await client.options(
            "/v1/chat/completions",
            headers={
                "Origin": ORIGIN,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": HI, "max_tokens": 2},
            headers={"Origin": ORIGIN},
        )
        assert chat.status_code == 200
        assert chat.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in chat.headers["access-control-expose-headers"]
        other = await client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


async def test_the_host_api_refuses_a_negative_keep_alive() -> None:
    async with serving_with() as (_, server):
        for bad in (-1.0, math.nan):
            with pytest.raises(InvalidRequest, match="keep_alive_s must be 0 or more"):
                server.runtime.generate("m", "hi", keep_alive_s=bad)
