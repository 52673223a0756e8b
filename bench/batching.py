"""Backend-level batching (``--scenarios batching``): one sequence alone vs four in a DecodeBatch.

No runtime, no sampling: greedy decode steps straight on ``MlxBackend`` (the B=1 loop, ``prefill``
of one token then ``logits``) and on a ``DecodeBatch`` of four prefilled sequences (one ``step``
feeds every row), on the calling thread. The engine-level numbers are ``gen.four.*``.

- ``batch.alone_tok_s``: decode tokens/s of one sequence on the B=1 loop.
- ``batch.four_tok_s``: aggregate decode tokens/s of four sequences in one ``DecodeBatch``.
- ``batch.four/alone``: the ratio (what batching buys at the backend, before any scheduling).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from bench.models import Scaled
from bench.prompts import encode, make_text
from bench.results import Measurement, median, ratio
from runtime.backends.mlx.backend import MlxBackend, MlxState
from runtime.backends.mlx.batch import DecodeBatch
from runtime.messages import ModelSpec

SYSTEM = "runtime"


@dataclass(frozen=True)
class BatchSizes:
    repetitions: int = 5
    prompt_tokens: int = 64
    steps: int = 32
    width: int = 4


BATCH_SIZES = Scaled(
    tiny=BatchSizes(),
    tiny_quick=BatchSizes(repetitions=1),
    real=BatchSizes(repetitions=3, steps=16),
    real_quick=BatchSizes(repetitions=1, prompt_tokens=16, steps=4),
)


def _greedy(logits: mx.array) -> int:
    token = mx.argmax(logits).item()
    assert isinstance(token, int)
    return token


def _prefilled(backend: MlxBackend, prompt: Sequence[int]) -> MlxState:
    state = backend.new_state()
    backend.prefill(state, prompt)
    assert isinstance(state, MlxState)
    return state


def _alone(backend: MlxBackend, prompt: Sequence[int], steps: int) -> float:
    """Tokens/s of ``steps`` greedy B=1 steps after ``prompt`` (the prefill is not timed)."""
    state = _prefilled(backend, prompt)
    token = _greedy(backend.logits(state))
    began = time.perf_counter()
    for _ in range(steps):
        backend.prefill(state, [token])
        token = _greedy(backend.logits(state))
    return steps / (time.perf_counter() - began)


def _batched(backend: MlxBackend, prompts: Sequence[Sequence[int]], steps: int) -> float:
    """Aggregate tokens/s of ``steps`` greedy batch steps over one row per prompt."""
    batch = DecodeBatch(backend)
    pending: dict[int, int] = {}
    for prompt in prompts:
        state = _prefilled(backend, prompt)
        pending[batch.join(state)] = _greedy(backend.logits(state))
    began = time.perf_counter()
    for _ in range(steps):
        out = batch.step(pending)
        pending = {slot: _greedy(logits) for slot, logits in out.items()}
    rate = len(prompts) * steps / (time.perf_counter() - began)
    for slot in list(pending):
        batch.leave(slot)
    return rate


def measure(path: Path, tokenizer: Any, name: str, sizes: BatchSizes) -> list[Measurement]:
    backend = MlxBackend.load(ModelSpec(name=name, backend="mlx", path=str(path)))
    try:
        reason = DecodeBatch.unsupported_reason(backend)
        if reason is not None:
            return [Measurement(SYSTEM, name, "batch.four/alone", None, "x", note=reason)]

        def prompt(seed: int) -> list[int]:
            return encode(tokenizer, make_text(tokenizer, sizes.prompt_tokens, seed))

        warmup = [prompt(17000 + i) for i in range(sizes.width)]
        _alone(backend, warmup[0], 2)
        _batched(backend, warmup, 2)
        alone: list[float] = []
        four: list[float] = []
        for rep in range(sizes.repetitions):
            prompts = [prompt(17100 + 10 * rep + i) for i in range(sizes.width)]
            alone.append(_alone(backend, prompts[0], sizes.steps))
            four.append(_batched(backend, prompts, sizes.steps))
    finally:
        backend.close()
    note = (
        f"backend level, {sizes.steps} greedy steps after {sizes.prompt_tokens}-token prompts, "
        f"{sizes.width} rows"
    )
    alone_m = _rates(name, "batch.alone_tok_s", alone)
    four_m = _rates(name, "batch.four_tok_s", four)
    four_over_alone = ratio(SYSTEM, name, "batch.four/alone", four_m.value, alone_m.value)
    return [alone_m, four_m, replace(four_over_alone, note=note)]


def _rates(name: str, scenario: str, samples: Sequence[float]) -> Measurement:
    rounded = [round(r, 1) for r in samples]
    return Measurement(SYSTEM, name, scenario, median(rounded), "tok/s", rounded)
