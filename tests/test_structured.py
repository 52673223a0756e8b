"""Constrained decoding on real (tiny) MLX models: every output follows its constraint, in a
batch beside unconstrained rows, on all three cache kinds; every grammar state is released."""

from __future__ import annotations

import json
import re

import anyio
import jsonschema
import msgspec
import pytest

from runtime.backends.loader import make_backend_loader
from runtime.errors import InvalidGrammar, InvalidSchema
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    Constraint,
    Failed,
    Finished,
    FinishReason,
    GrammarConstraint,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    ModelSpec,
    RegexConstraint,
    ReusePath,
    Sampling,
    TokensEmitted,
)
from runtime.testing.faults import Fault, FaultKind, FaultPlan, FaultPoint
from runtime.testing.harness import engine_stats, sim_spec, wait_until
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from runtime.text.constraints import live_matchers

pytestmark = pytest.mark.anyio

# Bounded everywhere (string lengths, integer range, array sizes), so a random-weight model's
# output always completes within MAX_TOKENS and is never cut at the length limit.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "kind", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 200


def spec(kind: TinyModelKind) -> ModelSpec:
    return ModelSpec(name=kind, path=str(tiny_model_path(kind)), backend="mlx")


async def run(
    rt: Runtime, model: str, constraint: Constraint | None, seed: int, **kwargs: object
) -> tuple[str, object]:
    sampling = Sampling(temperature=1.0, seed=seed, constraint=constraint)
    max_tokens = kwargs.pop("max_tokens", MAX_TOKENS)
    async with rt.generate(model, "Tell me:", max_tokens=max_tokens, sampling=sampling) as stream:
        events = [event async for event in stream]
    text = "".join(e.text for e in events if isinstance(e, TokensEmitted))
    return text, events[-1]


@pytest.mark.parametrize("kind", ["llama", "sliding", "hybrid"])
async def test_constrained_rows_follow_their_schema_in_a_batch_with_free_rows(
    kind: TinyModelKind,
) -> None:
    schema = JsonSchemaConstraint(schema=json.dumps(PERSON))
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec(kind))
        results: dict[int, tuple[str, object]] = {}

        async def one(index: int) -> None:
            results[index] = await run(rt, kind, schema if index % 2 == 0 else None, index)

        async with anyio.create_task_group() as tg:
            for index in range(4):
                tg.start_soon(one, index)
        counters = engine_stats(rt, loaded).counters
        assert counters["batch_steps"] > 0  # the constrained rows shared steps with free ones
        for index, (text, terminal) in results.items():
            assert isinstance(terminal, Finished)
            if index % 2 == 0:
                assert terminal.reason is FinishReason.STOP
                jsonschema.validate(json.loads(text), PERSON)
        assert engine_stats(rt, loaded).gauges["live_matchers"] == 0


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (RegexConstraint(pattern=r"[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
        (GrammarConstraint(grammar='start: "yes" | "no" | "maybe"'), r"yes|no|maybe"),
        (
            GrammarConstraint(grammar='root ::= "(" [a-c]{1,4} ")"', syntax="gbnf"),
            r"\([a-c]{1,4}\)",
        ),
    ],
)
async def test_regex_and_grammars_are_followed(constraint: Constraint, check: str) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec("llama"))
        for seed in range(3):
            text, terminal = await run(rt, "llama", constraint, seed)
            assert isinstance(terminal, Finished) and terminal.reason is FinishReason.STOP
            assert re.fullmatch(check, text), text
        assert live_matchers() == 0


async def test_json_mode_gives_an_object_or_a_length_cut() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(spec("llama"))
        text, terminal = await run(rt, "llama", JsonObjectConstraint(), 0, max_tokens=8)
        assert isinstance(terminal, Finished)
        # Truncated at max_tokens: finish_reason length, and the text is what was allowed so far.
        assert terminal.reason is FinishReason.LENGTH and text.startswith("{")
        assert live_matchers() == 0


async def test_invalid_schemas_and_grammars_are_refused_before_any_work() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(sim_spec("m"))
        refused: list[tuple[Constraint, type[Exception], str]] = [
            (JsonSchemaConstraint(schema='{"type": "strin"}'), InvalidSchema, "strin"),
            (JsonSchemaConstraint(schema="{not json"), InvalidSchema, "not valid JSON"),
            (JsonSchemaConstraint(schema="[1]"), InvalidSchema, "must be an object"),
            (RegexConstraint(pattern="a(b"), InvalidGrammar, "unclosed group"),
            (GrammarConstraint(grammar="start: foo"), InvalidGrammar, "unknown name"),
        ]
        for constraint, error, words in refused:
            with pytest.raises(error, match=words):
                await rt.complete("m", "x", sampling=Sampling(constraint=constraint))


async def test_a_backend_without_a_grammar_engine_fails_the_request_typed() -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        await rt.load_model(sim_spec("m"))
        done = await rt.complete("m", "x", sampling=Sampling(constraint=JsonObjectConstraint()))
        assert isinstance(done.terminal, Failed)
        assert done.terminal.code == "constraints_unsupported"


@pytest.mark.parametrize("kind", ["llama", "sliding"])
async def test_cancel_mid_generation_is_quiet_and_releases_the_grammar_state(
    kind: TinyModelKind,
) -> None:
    # A schema no random model finishes soon: a long free string.
    endless = JsonSchemaConstraint(schema=json.dumps({"type": "string", "minLength": 100}))
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec(kind))
        sampling = Sampling(temperature=1.0, seed=1, constraint=endless)
        events = []
        async with rt.generate(kind, "go", max_tokens=300, sampling=sampling, request_id="c") as s:
            async for event in s:
                events.append(event)
                if isinstance(event, TokensEmitted) and len(events) == 3:
                    assert await rt.cancel("c")
        assert isinstance(events[-1], Cancelled)
        assert not any(isinstance(e, Failed) for e in events)
        await wait_until(rt, lambda: engine_stats(rt, loaded).gauges["sequences"] == 0)
        assert engine_stats(rt, loaded).gauges["live_matchers"] == 0


async def test_a_constrained_request_adopts_the_prewarm_of_its_prompt() -> None:
    long_prompt = "word " * 600
    # Small, slowed chunks: the prewarm is still prefilling when the request comes.
    plan = FaultPlan(Fault(FaultPoint.PREFILL, FaultKind.SLOW, times=0, seconds=0.05))
    model = msgspec.structs.replace(spec("llama"), prefill_chunk_tokens=64)
    loader = plan.wrap_loader(make_backend_loader())
    async with (
        Runtime(RuntimeConfig(kv_budget_bytes=1 << 28), load_backend=loader) as rt,
        anyio.create_task_group() as tg,
    ):
        loaded = await rt.load_model(model)
        outcome: list[object] = []

        async def warm() -> None:
            outcome.append(await rt.prewarm("llama", long_prompt, session="s"))

        tg.start_soon(warm)
        await wait_until(
            rt, lambda: engine_stats(rt, loaded).counters.get("prefilled_tokens", 0) > 0
        )
        sampling = Sampling(constraint=RegexConstraint(pattern="[a-z]{1,5}"))
        done = await rt.complete(
            "llama", long_prompt + "?", max_tokens=10, sampling=sampling, session="s"
        )
    assert isinstance(done.terminal, Finished) and done.terminal.reason is FinishReason.STOP
    assert re.fullmatch("[a-z]{1,5}", done.text)
    assert done.started is not None and done.started.path is ReusePath.ADOPTED
    (warmed,) = outcome
    assert isinstance(warmed, Finished) and warmed.reason is FinishReason.ADOPTED
    assert live_matchers() == 0


@pytest.mark.parametrize("point", [FaultPoint.DECODE, FaultPoint.BATCH_STEP])
async def test_a_failed_step_releases_the_grammar_state(point: FaultPoint) -> None:
    plan = FaultPlan(Fault(point, FaultKind.RAISE, after=3))
    spec_ = spec("llama")
    config = RuntimeConfig(kv_budget_bytes=1 << 28)
    endless = JsonSchemaConstraint(schema=json.dumps({"type": "string", "minLength": 100}))
    async with Runtime(config, load_backend=plan.wrap_loader(make_backend_loader())) as rt:
        loaded = await rt.load_model(spec_)
        results: list[object] = []

        async def one(seed: int) -> None:
            results.append((await run(rt, "llama", endless, seed, max_tokens=100))[1])

        streams = 2 if point is FaultPoint.BATCH_STEP else 1  # a lone stream takes the fast path
        async with anyio.create_task_group() as tg:
            for seed in range(streams):
                tg.start_soon(one, seed)
        assert any(isinstance(r, Failed) and r.code == "backend_error" for r in results), results
        await wait_until(rt, lambda: engine_stats(rt, loaded).gauges["sequences"] == 0)
        assert live_matchers() == 0


async def test_a_superseded_constrained_request_releases_its_grammar_state() -> None:
    endless = JsonSchemaConstraint(schema=json.dumps({"type": "string", "minLength": 100}))
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec("llama"))
        sampling = Sampling(temperature=1.0, seed=3, constraint=endless)
        first = rt.generate("llama", "a", max_tokens=300, sampling=sampling, session="s")
        async with first:
            async for event in first:
                if isinstance(event, TokensEmitted):
                    break
            done = await rt.complete(
                "llama", "b", max_tokens=3, sampling=sampling, session="s", supersede=True
            )
            rest = [event async for event in first]
        assert isinstance(rest[-1], Cancelled) and rest[-1].reason == "superseded"
        assert isinstance(done.terminal, Finished)
        await wait_until(rt, lambda: engine_stats(rt, loaded).gauges["sequences"] == 0)
        assert live_matchers() == 0
