"""Constrained decoding (``--scenarios structured``, runtime only): the per-token cost of a JSON
Schema constraint against the same decode without one.

Both arms answer the same chat prompt greedily through the embedded ``Runtime``, the constrained
one under a schema asking for four people, the unconstrained one for at most as many tokens as the
constrained one wrote; they alternate, round by round, so drift in the machine's load cancels in
each round's ratio. Decode time runs from the first streamed token to the last, per token after
the first; coalescing is off, so every token is its own event. The ratio is what a constraint
costs per token: the mask (computed on a worker thread while the model steps, then applied) and
the lost pipelining (a constrained sequence reads each token before its next step is built).

- ``structured.decode_ms_per_token`` / ``structured.free_ms_per_token``: medians over the rounds;
- ``structured.constrained/free``: the median of the rounds' paired ratios.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import anyio

from bench.models import Scaled
from bench.results import Measurement
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, JsonSchemaConstraint, ModelSpec, Sampling, TokensEmitted
from runtime.text.coalesce import CoalescePolicy

SYSTEM = "runtime"
ROUNDS = Scaled(tiny=5, tiny_quick=1, real=5, real_quick=1)
MAX_TOKENS = 400

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}
# Four people: an answer of about 150 tokens on the real models, long enough to average a step's
# noise out; bounded strings and numbers, so a random-weight model cannot run to the limit in one.
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": _PERSON, "minItems": 4, "maxItems": 4}},
    "required": ["people"],
    "additionalProperties": False,
}
MESSAGES = (
    ChatMessage(
        "user", "Invent four people and describe them as JSON with name, age, hobbies and city."
    ),
)
_EVERY_TOKEN = CoalescePolicy(enabled=False)


async def _decode_ms_per_token(
    rt: Runtime, sampling: Sampling, max_tokens: int
) -> tuple[float, int] | None:
    """Decode ms per token after the first, and the tokens written (None: fewer than two)."""
    first: float | None = None
    count = 0
    async with rt.generate(
        "m", messages=MESSAGES, max_tokens=max_tokens, sampling=sampling, coalesce=_EVERY_TOKEN
    ) as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted) and event.token_ids:
                if first is None:
                    first = time.perf_counter()
                count += len(event.token_ids)
    if first is None or count < 2:
        return None
    return (time.perf_counter() - first) * 1e3 / (count - 1), count


async def _measure(path: Path, name: str, rounds: int) -> list[Measurement]:
    constrained = Sampling(constraint=JsonSchemaConstraint(schema=json.dumps(SCHEMA)))
    masked: list[float] = []
    free: list[float] = []
    async with Runtime(RuntimeConfig()) as rt:
        await rt.load_model(ModelSpec(name="m", path=str(path)))
        await _decode_ms_per_token(rt, constrained, 32)  # warm-up: the grammar's tokenizer, caches
        for _ in range(rounds):
            with_mask = await _decode_ms_per_token(rt, constrained, MAX_TOKENS)
            if with_mask is None:
                continue
            without = await _decode_ms_per_token(rt, Sampling(), with_mask[1])
            if without is None:  # the free arm ended at once (an EOS): no pair this round
                continue
            masked.append(with_mask[0])
            free.append(without[0])
    note = f"JSON Schema (four people) vs none, greedy, paired rounds: {len(masked)} of {rounds}"
    if not masked:
        return [Measurement(SYSTEM, name, "structured.constrained/free", None, "x", note=note)]
    ratios = [m / f for m, f in zip(masked, free, strict=True)]
    return [
        _median(name, "structured.decode_ms_per_token", masked, "ms"),
        _median(name, "structured.free_ms_per_token", free, "ms"),
        _median(name, "structured.constrained/free", ratios, "x", note),
    ]


def _median(
    name: str, scenario: str, values: list[float], unit: str, note: str = ""
) -> Measurement:
    samples = [round(v, 3) for v in values]
    return Measurement(
        SYSTEM, name, scenario, round(statistics.median(values), 3), unit, samples, note
    )


def measure(path: Path, name: str, rounds: int) -> list[Measurement]:
    return anyio.run(_measure, path, name, rounds)
