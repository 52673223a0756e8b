"""Where the llama.cpp tests may run: skipped without llama-cpp-python, except in CI."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from typing import Any

import pytest


def require_llama_cpp() -> None:
    """Skip (with one sentence) where llama-cpp-python is not installed; under ``CI``, which
    must run the llama.cpp tests (``make venv`` builds it), fail instead."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail("CI must run the llama.cpp tests: llama-cpp-python is not installed")
    pytest.skip("llama-cpp-python is not installed (pip install 'mlx-actor-runtime[llamacpp]')")


class StopAfter(threading.Event):
    """A stop flag that reads as set from its ``n``-th check on: llama.cpp checks it between graph
    nodes (so a large ``n`` lands inside a ``llama_decode``), the backend between calls."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.checks = 0

    def is_set(self) -> bool:
        self.checks += 1
        return self.checks >= self.n


def batch_greedy(
    backend: Any, states: Sequence[Any], steps: int
) -> tuple[Any, list[int], dict[int, list[int]]]:
    """``steps`` greedy tokens of every state, decoded together in one decode batch of
    ``backend``: the batch (still open), the slots in ``states``' order, the tokens by slot."""
    import mlx.core as mx

    batch = backend.open_batch()
    assert batch is not None
    slots = [batch.join(state) for state in states]
    drawn: dict[int, list[int]] = {slot: [] for slot in slots}
    logits = {slot: backend.logits(state) for slot, state in zip(slots, states, strict=True)}
    for _ in range(steps):
        tokens = {slot: int(mx.argmax(logits[slot]).item()) for slot in slots}
        for slot, token in tokens.items():
            drawn[slot].append(token)
        logits = batch.step(tokens)
    return batch, slots, drawn


def greedy(backend: Any, state: Any, n: int = 6) -> list[int]:
    """``n`` greedy tokens from the state's logits, fed one at a time (the B=1 path)."""
    import mlx.core as mx

    drawn: list[int] = []
    logits = backend.logits(state)
    for _ in range(n):
        drawn.append(int(mx.argmax(logits).item()))
        logits = backend.feed(state, mx.array(drawn[-1]))
    return drawn
