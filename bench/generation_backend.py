"""Generation scenario 1 at the backend level, no runtime: one stream's decode by the MLX
backend's own B=1 loop, by a ``DecodeBatch`` of one (the batching overhead alone), and by raw
mlx-lm's ``stream_generate``, on the same prompts and steps (``gen.one.backend_*``,
``gen.one.batch1/b1``, mlx-lm's ``gen.one.tok_s``)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import stream_generate

from bench.generation_inputs import SYSTEM, GenPrompts, GenSizes, tok_rates
from bench.results import Measurement
from runtime.backends.mlx.backend import MlxBackend, MlxState
from runtime.backends.mlx.batch import DecodeBatch
from runtime.messages import ModelSpec


def _greedy(logits: mx.array) -> int:
    token = mx.argmax(logits).item()
    assert isinstance(token, int)
    return token


def _backend_b1(backend: MlxBackend, prompt: Sequence[int], steps: int) -> tuple[float, list[int]]:
    """The backend's own B=1 loop: feed one token (``prefill``), read ``logits``, argmax."""
    state = backend.new_state()
    backend.prefill(state, prompt)
    token = _greedy(backend.logits(state))
    out = [token]
    began = time.perf_counter()
    for _ in range(steps):
        backend.prefill(state, [token])
        token = _greedy(backend.logits(state))
        out.append(token)
    return steps / (time.perf_counter() - began), out


def _batch_of_one(
    backend: MlxBackend, prompt: Sequence[int], steps: int
) -> tuple[float, list[int]]:
    """The same stream through a ``DecodeBatch`` holding only it (join, then ``step``)."""
    state = backend.new_state()
    backend.prefill(state, prompt)
    assert isinstance(state, MlxState)
    token = _greedy(backend.logits(state))
    out = [token]
    batch = DecodeBatch(backend)
    slot = batch.join(state)
    began = time.perf_counter()
    for _ in range(steps):
        token = _greedy(batch.step({slot: token})[slot])
        out.append(token)
    rate = steps / (time.perf_counter() - began)
    batch.leave(slot)
    return rate, out


def _mlx_lm(
    model: Any, tokenizer: Any, prompt: Sequence[int], steps: int
) -> tuple[float, list[int]]:
    """Raw mlx-lm ``stream_generate`` (greedy): steps + 1 tokens, timed from the first."""
    out: list[int] = []
    stamps: list[float] = []
    for response in stream_generate(model, tokenizer, list(prompt), max_tokens=steps + 1):
        out.append(int(response.token))
        stamps.append(time.perf_counter())
    return (len(out) - 1) / (stamps[-1] - stamps[0]), out


def measure_backend(
    path: Path, model: Any, tokenizer: Any, name: str, prompts: GenPrompts, sizes: GenSizes
) -> list[Measurement]:
    """Scenario 1, backend level and raw mlx-lm, on the calling thread (no runtime)."""
    backend = MlxBackend.load(ModelSpec(name=name, backend="mlx", path=str(path)))
    reason = DecodeBatch.unsupported_reason(backend)
    if reason is not None:
        backend.close()
        return [Measurement(SYSTEM, name, "gen.one.batch1/b1", None, "x", note=reason)]
    steps = sizes.one_steps
    _backend_b1(backend, prompts.warmup, 4)
    _batch_of_one(backend, prompts.warmup, 4)
    _mlx_lm(model, tokenizer, prompts.warmup, 4)
    b1, b1x, raw = [], [], []
    same_b1x = same_raw = True
    for prompt in prompts.one:
        rate_b1, tokens_b1 = _backend_b1(backend, prompt, steps)
        rate_b1x, tokens_b1x = _batch_of_one(backend, prompt, steps)
        rate_raw, tokens_raw = _mlx_lm(model, tokenizer, prompt, steps)
        b1.append(rate_b1)
        b1x.append(rate_b1x)
        raw.append(rate_raw)
        same_b1x &= tokens_b1x == tokens_b1
        same_raw &= tokens_raw == tokens_b1
    backend.close()
    b1_m = tok_rates(SYSTEM, name, "gen.one.backend_b1_tok_s", b1)
    b1x_m = tok_rates(SYSTEM, name, "gen.one.backend_batch1_tok_s", b1x)
    raw_m = tok_rates("mlx-lm", name, "gen.one.tok_s", raw)
    return [
        b1_m,
        b1x_m,
        Measurement(
            SYSTEM,
            name,
            "gen.one.batch1/b1",
            round(b1x_m.value / b1_m.value, 2) if b1x_m.value and b1_m.value else None,
            "x",
            note=f"backend level, {steps} greedy steps after a {len(prompts.one[0])}-token "
            f"prompt; DecodeBatch of one gives the same tokens as the B=1 loop: {same_b1x}; "
            f"mlx-lm stream_generate gives the same tokens: {same_raw}",
        ),
        raw_m,
    ]
