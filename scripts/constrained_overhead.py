"""Per-token cost of constrained decoding on a real model: the same prompts decoded with and
without a JSON Schema constraint, alternating, in one run; reports decode ms/token and the ratio.

Both arms answer the same chat prompt greedily, the unconstrained one for at most as many tokens
as the constrained one wrote, so the ratio is what a constraint costs per token: the mask (computed
on the worker thread while the model steps, then applied) and the lost pipelining (a constrained
sequence reads each token before it builds the next step). Not a test; the numbers go
into docs/structured.md.

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/constrained_overhead.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio

from runtime.api import Runtime
from runtime.config import RuntimeConfig
from runtime.messages import ChatMessage, JsonSchemaConstraint, ModelSpec, Sampling, TokensEmitted

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "hobbies", "city"],
    "additionalProperties": False,
}
# Four people: an answer of about 150 tokens, long enough that one step's noise averages out.
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 4, "maxItems": 4}},
    "required": ["people"],
    "additionalProperties": False,
}
MESSAGES = [
    ChatMessage(
        "user", "Invent four people and describe them as JSON with name, age, hobbies and city."
    )
]


async def decode_ms_per_token(
    rt: Runtime, model: str, sampling: Sampling, max_tokens: int
) -> tuple[float, int]:
    """Time from the first token to the last, per token after the first (decode only)."""
    first: float | None = None
    count = 0
    async with rt.generate(
        model, messages=MESSAGES, max_tokens=max_tokens, sampling=sampling
    ) as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted) and event.token_ids:
                if first is None:
                    first = time.perf_counter()
                count += len(event.token_ids)
    if first is None or count < 2:
        raise RuntimeError(f"the model produced {count} tokens: too few to time a decode")
    return (time.perf_counter() - first) * 1e3 / (count - 1), count


async def main(model: str, rounds: int) -> None:
    constrained = Sampling(constraint=JsonSchemaConstraint(schema=json.dumps(SCHEMA)))
    free: list[float] = []
    masked: list[float] = []
    lengths: list[int] = []
    async with Runtime(RuntimeConfig()) as rt:
        await rt.load_model(ModelSpec(name="m", path=model))
        await decode_ms_per_token(rt, "m", constrained, 64)  # warm-up: tokenizer import, caches
        for _ in range(rounds):
            ms, tokens = await decode_ms_per_token(rt, "m", constrained, 400)
            masked.append(ms)
            lengths.append(tokens)
            free.append((await decode_ms_per_token(rt, "m", Sampling(), tokens))[0])
    # Paired by round (the two arms ran back to back), so drift in the machine's load cancels.
    ratio = statistics.median(m / f for m, f in zip(masked, free, strict=True))
    print(
        f"{model}: decode ms/token unconstrained {statistics.median(free):.2f}, constrained "
        f"{statistics.median(masked):.2f} (medians of {rounds}, {statistics.median(lengths):.0f} "
        f"tokens); median paired ratio {ratio:.3f}"
    )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    anyio.run(main, args.model, args.rounds)


if __name__ == "__main__":
    cli()
