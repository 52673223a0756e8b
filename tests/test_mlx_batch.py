"""DecodeBatch on the tiny offline models: batched greedy decoding matches decoding alone.

Equivalence criterion: the token streams are equal, or, where batching changes the float order
only enough to flip a near-tie, at the first divergence each side's token is among the other's
top-5 logits, after which the comparison stops (the streams are then legitimately different).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import pytest

from runtime.backends.mlx.backend import MlxBackend, MlxState
from runtime.backends.mlx.batch import DecodeBatch
from runtime.messages import ModelSpec
from runtime.testing.tiny_models import SLIDING_WINDOW, TinyModelKind, tiny_model_path

KINDS: tuple[TinyModelKind, ...] = ("llama", "sliding", "hybrid")
TOP_K = 5
LOGITS_ATOL = 1e-3


def load(kind: TinyModelKind, **options: str | int | float | bool | None) -> MlxBackend:
    spec = ModelSpec(name=kind, path=str(tiny_model_path(kind)), backend="mlx", options=options)
    return MlxBackend.load(spec)


@pytest.fixture(scope="module")
def backends() -> dict[str, MlxBackend]:
    return {kind: load(kind) for kind in KINDS}


def tokens(n: int, seed: int) -> list[int]:
    """``n`` ordinary (non-special) token ids, deterministic per seed."""
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def prefilled(backend: MlxBackend, ids: Sequence[int]) -> MlxState:
    state = backend.new_state()
    backend.prefill(state, ids)
    return state


def argmax(logits: mx.array) -> int:
    return cast(int, mx.argmax(logits).item())


@dataclass
class Trace:
    """Greedy tokens and, for each, the logits it was chosen from."""

    tokens: list[int] = field(default_factory=list)
    logits: list[mx.array] = field(default_factory=list)

    def add(self, logits: mx.array) -> int:
        token = argmax(logits)
        self.tokens.append(token)
        self.logits.append(logits)
        return token


def alone(backend: MlxBackend, state: MlxState, n: int) -> Trace:
    """``n`` greedy tokens of a prefilled ``state`` decoded on the B=1 path (extends it)."""
    trace = Trace()
    for _ in range(n):
        backend.prefill(state, [trace.add(backend.logits(state))])
    return trace


def continue_alone(backend: MlxBackend, state: MlxState, trace: Trace, n: int) -> None:
    """Feed ``trace``'s pending last token to a state that left a batch, then ``n`` more."""
    for _ in range(n):
        backend.prefill(state, [trace.tokens[-1]])
        trace.add(backend.logits(state))


def in_top_k(logits: mx.array, token: int) -> bool:
    top = cast(list[int], mx.argpartition(-logits, TOP_K - 1)[:TOP_K].tolist())
    return token in top


def assert_equivalent(got: Trace, want: Trace, what: str) -> None:
    """Equal streams, or a near-tie flip at the first divergence (see the module docstring).

    Up to the divergence the logits must also agree closely (float32 models: batching only
    reorders sums, so differences are ~1e-5; a masking or position bug is far larger).
    """
    n = min(len(got.tokens), len(want.tokens))
    assert n > 0, what
    for i in range(n):
        a, b = got.tokens[i], want.tokens[i]
        if a != b:
            assert in_top_k(want.logits[i], a) and in_top_k(got.logits[i], b), (
                f"{what}: step {i} chose {a} vs {b}, not a near-tie\n"
                f"got  {got.tokens}\nwant {want.tokens}"
            )
            return
        assert mx.allclose(got.logits[i], want.logits[i], atol=LOGITS_ATOL).item(), (
            f"{what}: step {i} logits differ by "
            f"{mx.max(mx.abs(got.logits[i] - want.logits[i])).item()}"
        )


class Driver:
    """Runs a DecodeBatch greedily, keeping one Trace per slot."""

    def __init__(self, backend: MlxBackend) -> None:
        self.batch = DecodeBatch(backend)
        self.traces: dict[int, Trace] = {}
        self.pending: dict[int, int] = {}

    def join(self, state: MlxState) -> int:
        assert state.logits is not None
        slot = self.batch.join(state)
        self.traces[slot] = Trace()
        self.pending[slot] = self.traces[slot].add(state.logits)
        return slot

    def leave(self, slot: int) -> MlxState:
        del self.pending[slot]
        return self.batch.leave(slot)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            out = self.batch.step(self.pending)
            assert set(out) == set(self.pending)
            self.pending = {slot: self.traces[slot].add(logits) for slot, logits in out.items()}


# ---------------------------------------------------------------------- capability


@pytest.mark.parametrize("kind", KINDS)
def test_every_tiny_kind_is_batchable(backends: dict[str, MlxBackend], kind: str) -> None:
    assert DecodeBatch.supports(backends[kind])
    assert DecodeBatch.unsupported_reason(backends[kind]) is None


def test_quantized_kv_cache_stays_on_the_single_path() -> None:
    backend = load("llama", kv_bits=8)
    assert not DecodeBatch.supports(backend)
    assert "QuantizedKVCache" in (DecodeBatch.unsupported_reason(backend) or "")
    with pytest.raises(ValueError, match="cannot be decoded in a batch"):
        DecodeBatch(backend)


def test_misuse_is_refused(backends: dict[str, MlxBackend]) -> None:
    backend = backends["llama"]
    batch = DecodeBatch(backend)
    assert batch.step({}) == {}
    with pytest.raises(ValueError, match="prefilled"):
        batch.join(backend.new_state())
    slot = batch.join(prefilled(backend, tokens(4, 0)))
    with pytest.raises(ValueError, match="one token per member"):
        batch.step({})
    with pytest.raises(ValueError, match="one token per member"):
        batch.step({slot: 7, slot + 1: 7})
    with pytest.raises(KeyError):
        batch.leave(slot + 1)
    state = batch.leave(slot)
    assert state.n_tokens == 4 and len(batch) == 0 and batch.nbytes == 0


# ---------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("kind", KINDS)
def test_batch_matches_alone(backends: dict[str, MlxBackend], kind: str) -> None:
    """(1) Three prompts of different lengths, decoded together, decode as they do alone."""
    backend = backends[kind]
    prompts = [tokens(5, 1), tokens(19, 2), tokens(37, 3)]
    states = [prefilled(backend, p) for p in prompts]
    driver = Driver(backend)
    slots = [driver.join(s) for s in states]
    driver.step(8)
    for slot, state, prompt in zip(slots, states, prompts, strict=True):
        assert driver.batch.length(slot) == len(prompt) + 8
        # join() only read the state: it still decodes alone from the prompt.
        assert state.n_tokens == len(prompt)
        want = alone(backend, state, 9)
        assert_equivalent(driver.traces[slot], want, f"{kind} prompt {len(prompt)}")


@pytest.mark.parametrize("kind", KINDS)
def test_join_and_leave_midway_do_not_disturb_others(
    backends: dict[str, MlxBackend], kind: str
) -> None:
    """(2) A sequence joining at step 3 and one leaving at step 5 leave the others unchanged."""
    backend = backends[kind]
    prompts = {"a": tokens(6, 11), "b": tokens(23, 12), "late": tokens(41, 13), "c": tokens(3, 14)}
    driver = Driver(backend)
    slot = {name: driver.join(prefilled(backend, prompts[name])) for name in ("a", "b", "c")}
    driver.step(3)
    slot["late"] = driver.join(prefilled(backend, prompts["late"]))
    driver.step(2)
    driver.leave(slot["b"])  # the middle row leaves
    driver.step(5)
    for name, steps in (("a", 10), ("b", 5), ("c", 10), ("late", 7)):
        got = driver.traces[slot[name]]
        assert len(got.tokens) == steps + 1
        want = alone(backend, prefilled(backend, prompts[name]), steps + 1)
        assert_equivalent(got, want, f"{kind} {name}")


@pytest.mark.parametrize("kind", KINDS)
def test_left_state_continues_alone_and_can_rejoin(
    backends: dict[str, MlxBackend], kind: str
) -> None:
    """(3) leave() gives an independent state whose B=1 decode continues the batch's stream."""
    backend = backends[kind]
    prompts = [tokens(9, 21), tokens(30, 22), tokens(4, 23)]
    # Reference: all three stay in the batch for 12 steps.
    reference = Driver(backend)
    ref_slots = [reference.join(prefilled(backend, p)) for p in prompts]
    reference.step(12)

    driver = Driver(backend)
    slots = [driver.join(prefilled(backend, p)) for p in prompts]
    driver.step(4)
    leaver = slots[1]
    trace = driver.traces[leaver]
    last_logits = driver.batch.logits(leaver)
    state = driver.leave(leaver)
    assert state.n_tokens == len(prompts[1]) + 4
    assert state.logits is not None and last_logits is not None
    assert mx.array_equal(state.logits, last_logits)
    assert type(state.caches[0]) in {type(c) for c in backend.new_state().caches}
    # Interleave: the batch keeps stepping while the left state decodes alone, 4 tokens.
    for _ in range(4):
        driver.step()
        continue_alone(backend, state, trace, 1)
    # Rejoin (e.g. after preemption) and finish in the batch.
    rejoined = driver.batch.join(state)
    driver.traces[rejoined] = trace
    driver.pending[rejoined] = trace.tokens[-1]
    driver.step(4)
    assert driver.batch.length(rejoined) == len(prompts[1]) + 12
    for slot, ref_slot in ((slots[0], ref_slots[0]), (rejoined, ref_slots[1])):
        assert_equivalent(driver.traces[slot], reference.traces[ref_slot], f"{kind} {slot}")
    assert_equivalent(driver.traces[slots[2]], reference.traces[ref_slots[2]], f"{kind} short")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("together", [False, True], ids=["decoded", "prefilled-together"])
def test_a_state_out_of_a_batch_grows_within_its_kv_price(
    backends: dict[str, MlxBackend], kind: str, together: bool
) -> None:
    """A row leaves at a length that is no whole allocation step and decodes on alone: its cache
    must still grow in the whole steps ``ModelInfo.kv_bytes`` prices. (mlx-lm's ``extract`` gives
    the row a buffer of its exact length, and the next token then grew it one step past that: the
    prefix entry it became held more bytes than its sequence had reserved.)"""
    backend = backends[kind]
    prompts = [tokens(9, 61), tokens(30, 62)]
    if together:
        states = [backend.new_state() for _ in prompts]
        backend.prefill_together(states, prompts)
        state, trace = states[1], Trace()
        trace.add(backend.logits(state))
    else:
        driver = Driver(backend)
        slots = [driver.join(prefilled(backend, p)) for p in prompts]
        driver.step(3)
        state, trace = driver.leave(slots[1]), driver.traces[slots[1]]
    continue_alone(backend, state, trace, 4)
    priced = backend.info.kv_bytes(state.n_tokens)
    assert backend.state_nbytes(state) <= priced, f"{state.n_tokens} tokens"


def test_sliding_window_past_the_window(backends: dict[str, MlxBackend]) -> None:
    """(4) Rows past the sliding window (ring buffers wrapped) still decode as they do alone.

    A 50-token prompt starts wrapped; a 7-token one crosses the window mid-run; a 50-token row
    joins a wrapped batch mid-way; a wrapped row leaves and continues alone.
    """
    backend = backends["sliding"]
    assert SLIDING_WINDOW == 32
    prompts = {"long": tokens(50, 31), "short": tokens(7, 32), "late": tokens(50, 33)}
    prompts["leaver"] = tokens(45, 34)
    driver = Driver(backend)
    slot = {name: driver.join(prefilled(backend, prompts[name])) for name in ("long", "short")}
    slot["leaver"] = driver.join(prefilled(backend, prompts["leaver"]))
    driver.step(6)
    slot["late"] = driver.join(prefilled(backend, prompts["late"]))
    driver.step(6)
    left = driver.leave(slot["leaver"])
    leaver_trace = driver.traces[slot["leaver"]]
    continue_alone(backend, left, leaver_trace, 8)  # the left row goes on alone
    driver.step(28)  # "short" reaches 7 + 40 tokens: well past the window
    assert driver.batch.length(slot["short"]) == 7 + 40 > SLIDING_WINDOW
    for name, n in (("long", 41), ("short", 41), ("late", 35), ("leaver", 21)):
        got = leaver_trace if name == "leaver" else driver.traces[slot[name]]
        assert len(got.tokens) == n
        want = alone(backend, prefilled(backend, prompts[name]), n)
        assert_equivalent(got, want, f"sliding {name}")


def test_batch_shrinks_when_its_longest_row_leaves(backends: dict[str, MlxBackend]) -> None:
    """filter() drops the left padding every remaining row shares (the documented leave cost)."""
    backend = backends["llama"]
    driver = Driver(backend)
    long_slot = driver.join(prefilled(backend, tokens(200, 51)))
    short_slot = driver.join(prefilled(backend, tokens(3, 52)))
    driver.step(2)
    before = driver.batch.nbytes
    driver.leave(long_slot)
    assert driver.batch.nbytes < before / 2
    driver.step(2)
    want = alone(backend, prefilled(backend, tokens(3, 52)), 5)
    assert_equivalent(driver.traces[short_slot], want, "short after the long row left")
