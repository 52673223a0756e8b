"""Every output under a JSON Schema parses and validates against it (the independent
``jsonschema`` validator), over schemas drawn from a small grammar of JSON Schemas: objects whose
properties are strings, integers, booleans, enums, arrays of those, or such objects, nested up to
depth 2, with drawn ``required`` lists. On a tiny random-weight model and on the real default one
(``real_model``), and through the official ``openai`` client's ``chat.completions.parse`` against
a real ``mlxrt serve``."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.backends.model_source import prepare_model
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Finished,
    FinishReason,
    JsonSchemaConstraint,
    ModelSpec,
    Sampling,
    TokensEmitted,
)
from runtime.testing.tiny_models import tiny_model_path
from runtime.text.constraints import live_matchers

Schema = dict[str, Any]
NAMES = st.sampled_from(["a", "b", "name", "count", "ok", "items", "x_y"])

# Bounded leaves (string length, integer range, array size): a random model's output always
# completes well within the token limit, so every output must validate.
LEAVES: st.SearchStrategy[Schema] = st.one_of(
    st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
    st.integers(-50, 50).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 99}),
    st.just({"type": "boolean"}),
    st.lists(
        st.sampled_from(["red", "green", "blue", "x"]), min_size=1, max_size=3, unique=True
    ).map(lambda values: {"enum": values}),
)


def objects(values: st.SearchStrategy[Schema]) -> st.SearchStrategy[Schema]:
    @st.composite
    def build(draw: st.DrawFn) -> Schema:
        properties = draw(st.dictionaries(NAMES, values, min_size=1, max_size=3))
        required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
        return {
            "type": "object",
            "properties": properties,
            "required": required,
            "additionalProperties": False,
        }

    return build()


def arrays(items: st.SearchStrategy[Schema]) -> st.SearchStrategy[Schema]:
    return st.builds(
        lambda item, most: {"type": "array", "items": item, "maxItems": most},
        items,
        st.integers(0, 3),
    )


DEPTH_1 = objects(st.one_of(LEAVES, arrays(LEAVES)))
SCHEMAS = objects(st.one_of(LEAVES, arrays(LEAVES), DEPTH_1))  # nested up to depth 2


async def generate_under(
    rt: Runtime, model: str, schema: Schema, seed: int, namespace: str = "default"
) -> tuple[str, Any]:
    sampling = Sampling(
        temperature=1.0, seed=seed, constraint=JsonSchemaConstraint(schema=json.dumps(schema))
    )
    async with rt.generate(
        model, "JSON please:", max_tokens=400, sampling=sampling, namespace=namespace
    ) as stream:
        events = [event async for event in stream]
    return "".join(e.text for e in events if isinstance(e, TokensEmitted)), events[-1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_tiny_model_outputs_validate_against_drawn_schemas(schema: Schema, seed: int) -> None:
    jsonschema.Draft202012Validator.check_schema(schema)  # the grammar draws real schemas

    async def main() -> tuple[str, Any]:
        spec = ModelSpec(name="t", path=str(tiny_model_path("llama")), backend="mlx")
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
            await rt.load_model(spec)
            return await generate_under(rt, "t", schema, seed)

    text, terminal = anyio.run(main)
    assert isinstance(terminal, Finished) and terminal.reason is FinishReason.STOP, terminal
    jsonschema.validate(json.loads(text), schema)
    assert live_matchers() == 0


@pytest.fixture(scope="module")
def default_model(
    real_gguf: Callable[[str], Path],
) -> Iterator[tuple[anyio.from_thread.BlockingPortal, Runtime]]:
    """The default model loaded once, in a Runtime driven through a blocking portal (its load
    costs more than a drawn schema's generation)."""
    real_gguf("smollm2-135m-instruct")
    with contextlib.ExitStack() as stack:
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        rt = stack.enter_context(portal.wrap_async_context_manager(Runtime(RuntimeConfig())))
        portal.call(rt.load_model, ModelSpec(name="smol", path="smollm2-135m-instruct"))
        yield portal, rt


EXAMPLES = itertools.count()


@pytest.mark.real_model
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=SCHEMAS)
def test_the_default_model_outputs_validate_against_drawn_schemas(
    default_model: tuple[anyio.from_thread.BlockingPortal, Runtime], schema: Schema
) -> None:
    portal, rt = default_model
    # A namespace per example: none reuses another's cached prompt, as if each had its Runtime.
    namespace = f"example-{next(EXAMPLES)}"
    text, terminal = portal.call(generate_under, rt, "smol", schema, 0, namespace)
    assert isinstance(terminal, Finished) and terminal.reason is FinishReason.STOP, terminal
    jsonschema.validate(json.loads(text), schema)
    assert live_matchers() == 0


@pytest.mark.real_model
def test_openai_parse_with_a_pydantic_model_against_mlxrt_serve(
    real_gguf: Callable[[str], Path],
) -> None:
    import openai
    import pydantic

    from bench.serving import mlxrt_serve, running

    real_gguf("smollm2-135m-instruct")
    model_dir = prepare_model(ModelSpec(name="smol", path="smollm2-135m-instruct")).path

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population: int = pydantic.Field(ge=0, le=100_000_000)

    with (
        running([mlxrt_serve(model_dir, "smol")]) as (server,),
        openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none") as client,
    ):
        completion = client.chat.completions.parse(
            model="smol",
            messages=[{"role": "user", "content": "Describe Paris as JSON."}],
            response_format=City,
            max_completion_tokens=300,
            temperature=0,
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, City)
