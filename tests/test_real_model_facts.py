"""What the runtime prices a real model's KV cache at, against the bytes its real cache holds.

Backend level (no Runtime), on the test thread, like tests/test_mlx_backend.py: each (model,
weights/KV option) is loaded once per module. ``ModelInfo.kv_bytes(n, chunk)`` is what a sequence
of ``n`` tokens reserves (docs/design.md, "KV accounting"); ``MlxBackend.state_nbytes`` is what its
cache really occupies.

``weights="quantized"`` keeps the GGUF's half-precision scales; on a CPU the backend widens them
to float32 at load (a half-precision quantized matmul runs ~45x slower there).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence

import pytest

from runtime.backends.mlx.backend import MlxBackend, MlxState
from runtime.backends.model_source import prepare_model
from runtime.messages import ModelSpec

pytestmark = pytest.mark.real_model

SMOLLM2, GEMMA = "smollm2-135m-instruct", "gemma3-270m"
CHUNK = 256  # the runtime's default prefill chunk
OPTIONS: dict[str, dict[str, str | int | float | bool | None]] = {
    "float32": {},  # the default on a CPU
    "kv_bits=8": {"kv_bits": 8},
    "quantized": {"weights": "quantized"},
}
TEXT = "The keeper climbed the hundred and twelve steps with a can of oil every evening. " * 60

Load = Callable[[str, str], MlxBackend]


@pytest.fixture(scope="module")
def load(real_gguf: Callable[[str], object]) -> Iterator[Load]:
    """``load(model, options)``: the model loaded with ``OPTIONS[options]``, once per module."""
    loaded: dict[tuple[str, str], MlxBackend] = {}

    def get(model: str, options: str) -> MlxBackend:
        real_gguf(model)  # skips (or fails under CI) like every real-model test
        if (model, options) not in loaded:
            spec = ModelSpec(name=f"{model} {options}", path=model, options=OPTIONS[options])
            loaded[(model, options)] = MlxBackend.load(spec)
        return loaded[(model, options)]

    yield get
    for backend in loaded.values():
        backend.close()


def prefilled(backend: MlxBackend, ids: Sequence[int]) -> MlxState:
    state = backend.new_state()
    for start in range(0, len(ids), CHUNK):
        backend.prefill(state, ids[start : start + CHUNK])
    return state


def close_to(estimate: int, actual: int) -> str | None:
    """None within 10% of ``actual``, else what is wrong."""
    if abs(estimate - actual) <= 0.10 * actual:
        return None
    return (
        f"estimated {estimate} B, the cache holds {actual} B ({(estimate - actual) / actual:+.1%})"
    )


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize(
    ("model", "n"),
    [(SMOLLM2, 300), (GEMMA, 520)],  # Gemma: past its 512-token window, so the ring has wrapped
    ids=[SMOLLM2, GEMMA],
)
def test_the_price_matches_a_prefilled_cache(load: Load, model: str, n: int, options: str) -> None:
    backend = load(model, options)
    state = prefilled(backend, backend.encode(TEXT)[:n])
    assert state.length == n
    problem = close_to(backend.info.kv_bytes(n, chunk_tokens=CHUNK), backend.state_nbytes(state))
    assert problem is None, f"{model} {options}, {n} tokens: {problem}"


@pytest.mark.parametrize("model", [SMOLLM2, GEMMA])
def test_bytes_per_token_follow_the_model_config(load: Load, model: str) -> None:
    """Each layer keeps keys and values (2 x kv heads x head dim per token): float32 with float32
    weights; with kv_bits=8 a byte each plus a float32 scale and bias per group of 64 values, on
    the full-attention layers only. Gemma 3: every 6th layer full attention, the others rings."""
    dense, kv8 = load(model, "float32"), load(model, "kv_bits=8")
    path = prepare_model(ModelSpec(name=model, path=model)).path  # the cached conversion
    config = json.loads((path / "config.json").read_text())
    layers = config["num_hidden_layers"]
    full = layers // config.get("sliding_window_pattern", 1)
    values = 2 * config["num_key_value_heads"] * config["head_dim"]
    assert dense.info.bytes_per_token == full * values * 4
    assert dense.info.window_bytes_per_token == (layers - full) * values * 4
    assert kv8.info.bytes_per_token == full * values * (1 + 2 * 4 / 64)
    assert kv8.info.window_bytes_per_token == dense.info.window_bytes_per_token
    assert dense.info.window_tokens == config.get("sliding_window")


# ---------------------------------------------------------------------- while decoding

# mlx-lm grows caches by whole 256-token steps; a reservation covers the cache for the whole
# request, so the price follows that growth in the two cases these tests once found it short:
# a sliding ring below its window grows a whole step on a one-token update (Gemma: a 300-token
# prompt's rings hold 512 tokens after its first decode step), and a state restored at an
# unaligned length grew a whole step from there (299 + 256 = 555 tokens; copies now keep
# capacity up to the next step boundary).
PROMPT, STEPS = 300, 4


def decode(backend: MlxBackend, state: MlxState, steps: int) -> None:
    """One-token updates, as the engine's decode steps feed the model."""
    for token in backend.encode(TEXT)[:steps]:
        backend.prefill(state, [token])


@pytest.mark.parametrize(
    "model",
    [SMOLLM2, GEMMA],
)
def test_the_price_covers_a_short_prompt_while_it_decodes(load: Load, model: str) -> None:
    backend = load(model, "float32")
    state = prefilled(backend, backend.encode(TEXT)[:PROMPT])
    decode(backend, state, STEPS)
    price = backend.info.kv_bytes(PROMPT + STEPS, chunk_tokens=CHUNK)
    assert backend.state_nbytes(state) <= price, f"{backend.state_nbytes(state)} B > {price} B"


@pytest.mark.parametrize("model", [SMOLLM2, GEMMA])
def test_the_price_covers_a_restored_state_while_it_decodes(load: Load, model: str) -> None:
    """An exact repeat: the entry cut back to all but the last prompt token, then that token."""
    backend = load(model, "float32")
    ids = backend.encode(TEXT)[:PROMPT]
    state = backend.copy_state(prefilled(backend, ids), PROMPT - 1)
    backend.prefill(state, ids[-1:])
    decode(backend, state, STEPS)
    price = backend.info.kv_bytes(PROMPT + STEPS, chunk_tokens=CHUNK)
    assert backend.state_nbytes(state) <= price, f"{backend.state_nbytes(state)} B > {price} B"
