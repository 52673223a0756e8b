"""The MLX backend on the tiny offline models: cache layout, state copies, teardown, load errors.

Synchronous and backend-level (no Runtime): each tiny model is loaded once per module.
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from runtime.backends.contract import CannotTrim, PrefillInterrupted, ReuseStrategy
from runtime.backends.mlx.backend import MlxBackend, MlxState
from runtime.errors import ModelLoadFailed
from runtime.messages import ModelSpec
from runtime.testing.tiny_models import SLIDING_WINDOW, TinyModelKind, tiny_model_path

KINDS: tuple[TinyModelKind, ...] = ("llama", "sliding", "hybrid")


def load(kind: TinyModelKind, **options: str | int | float | bool | None) -> MlxBackend:
    spec = ModelSpec(name=kind, path=str(tiny_model_path(kind)), backend="mlx", options=options)
    return MlxBackend.load(spec)


@pytest.fixture(scope="module")
def backends() -> dict[str, MlxBackend]:
    return {kind: load(kind) for kind in KINDS}


def tokens(n: int, seed: int = 0) -> list[int]:
    """``n`` ordinary (non-special) token ids, deterministic per seed."""
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


def prefilled(
    backend: MlxBackend, ids: Sequence[int], chunk: int | None = None, logits: bool = True
) -> MlxState:
    state = backend.new_state()
    step = chunk or max(len(ids), 1)
    for start in range(0, len(ids), step):
        backend.prefill(state, ids[start : start + step], logits=logits)
    return state


def greedy(backend: MlxBackend, state: MlxState, n: int) -> list[int]:
    """Greedy continuation of ``state`` (extends it)."""
    out: list[int] = []
    for _ in range(n):
        token = int(mx.argmax(backend.logits(state)).item())
        out.append(token)
        backend.prefill(state, [token])
    return out


# ---------------------------------------------------------------------- info


@pytest.mark.parametrize(
    ("kind", "reuse"),
    [
        ("llama", ReuseStrategy.TRIM),
        ("sliding", ReuseStrategy.CHECKPOINT),
        ("hybrid", ReuseStrategy.CHECKPOINT),
    ],
)
def test_info_reports_the_reuse_path_and_model_facts(
    backends: dict[str, MlxBackend], kind: str, reuse: ReuseStrategy
) -> None:
    info = backends[kind].info
    assert info.reuse is reuse
    assert info.reuse_reason
    assert info.eos_token_ids  # the tiny models declare eos_token_id [3, 1]
    assert info.eos_token_ids == {1, 3}
    assert info.context_length == 2048
    assert info.vocab_size == 512
    assert info.bytes_per_token > 0
    if kind == "sliding":
        assert info.window_tokens == SLIDING_WINDOW
        assert info.window_bytes_per_token > 0
    if kind == "hybrid":
        assert info.fixed_state_bytes > 0
    assert info.pass_s > 0
    # An interruptible pass checks at each attention layer (hybrid: 2 of its 4 are recurrent).
    assert info.stop_checks == (2 if kind == "hybrid" else 4)


# ---------------------------------------------------------------------- KV estimate


def _assert_estimate_close(backend: MlxBackend, state: MlxState, n: int, chunk: int) -> None:
    estimate, actual = backend.info.kv_bytes(n, chunk_tokens=chunk), backend.state_nbytes(state)
    assert actual > 0
    assert abs(estimate - actual) <= 0.10 * actual, (
        f"{n} tokens: estimated {estimate} B, the cache holds {actual} B "
        f"({(estimate - actual) / actual:+.1%})"
    )


@pytest.mark.parametrize("n", [20, 100, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_kv_estimate_matches_the_real_cache_after_one_prefill(
    backends: dict[str, MlxBackend], kind: str, n: int
) -> None:
    # No logits, as a chunk before the prompt's last: the ring then holds window - 1 + chunk
    # tokens, the most it ever holds (a last token run apart for its logits trims it to a window).
    backend = backends[kind]
    _assert_estimate_close(backend, prefilled(backend, tokens(n), logits=False), n, chunk=n)


@pytest.mark.parametrize("n", [20, 100, 300])
@pytest.mark.parametrize("kind", KINDS)
def test_kv_estimate_matches_the_real_cache_after_chunked_prefill(
    backends: dict[str, MlxBackend], kind: str, n: int
) -> None:
    # The engine prefills in chunks (here 16, as the runtime tests configure it).
    backend = backends[kind]
    _assert_estimate_close(backend, prefilled(backend, tokens(n), chunk=16), n, chunk=16)


@pytest.fixture(scope="module")
def quantized_llama() -> MlxBackend:
    return load("llama", kv_bits=8)


@pytest.mark.parametrize("n", [20, 100, 300])
def test_kv_estimate_matches_a_quantized_cache(quantized_llama: MlxBackend, n: int) -> None:
    state = prefilled(quantized_llama, tokens(n))
    assert all(type(c).__name__ == "QuantizedKVCache" for c in state.caches)
    _assert_estimate_close(quantized_llama, state, n, chunk=n)


# ---------------------------------------------------------------------- copy_state


@pytest.mark.parametrize("kind", KINDS)
def test_extending_a_copy_never_changes_the_original(
    backends: dict[str, MlxBackend], kind: str
) -> None:
    backend = backends[kind]
    prompt = tokens(40, seed=1)
    reference = greedy(backend, prefilled(backend, prompt), 4)

    original = prefilled(backend, prompt)
    copy = backend.copy_state(original, original.length)
    assert copy.length == original.length
    backend.prefill(copy, tokens(50, seed=2))  # past the sliding window, past recurrent steps
    assert copy.length == 90
    assert original.length == 40
    assert greedy(backend, original, 4) == reference
    # A second copy taken after the first was extended is still the pristine prompt state.
    original = prefilled(backend, prompt)
    first = backend.copy_state(original, original.length)
    greedy(backend, first, 3)
    second = backend.copy_state(original, original.length)
    assert greedy(backend, second, 4) == reference


def test_a_trimmed_copy_continues_like_a_cold_prefill(backends: dict[str, MlxBackend]) -> None:
    backend = backends["llama"]
    shared = tokens(30, seed=3)
    first = shared + tokens(20, seed=4)
    second = shared + tokens(25, seed=5)
    cold = greedy(backend, prefilled(backend, second), 6)

    entry = prefilled(backend, first)
    assert backend.can_trim(entry)
    for k in (1, 17, 30):
        copy = backend.copy_state(entry, k)
        assert copy.length == k
        backend.prefill(copy, second[k:])
        assert greedy(backend, copy, 6) == cold, f"trimmed to {k}"
    assert entry.length == len(first)
    assert greedy(backend, entry, 6) == greedy(backend, prefilled(backend, first), 6)


def test_sliding_state_is_trimmable_only_before_the_window_wraps(
    backends: dict[str, MlxBackend],
) -> None:
    backend = backends["sliding"]
    short = prefilled(backend, tokens(20, seed=6))
    assert backend.can_trim(short)
    trimmed = backend.copy_state(short, 12)
    assert trimmed.length == 12

    long = prefilled(backend, tokens(40, seed=6))  # window is 32
    assert not backend.can_trim(long)
    with pytest.raises(CannotTrim):
        backend.copy_state(long, 39)
    full = backend.copy_state(long, 40)  # a whole copy is always allowed
    assert full.length == 40


def test_hybrid_state_is_never_trimmable(backends: dict[str, MlxBackend]) -> None:
    backend = backends["hybrid"]
    for n in (1, 5, 40):
        state = prefilled(backend, tokens(n, seed=7))
        assert not backend.can_trim(state)
        if n > 1:
            with pytest.raises(CannotTrim):
                backend.copy_state(state, n - 1)
        assert backend.copy_state(state, n).length == n


@pytest.mark.parametrize("kind", KINDS)
def test_copy_beyond_the_state_raises(backends: dict[str, MlxBackend], kind: str) -> None:
    backend = backends[kind]
    state = prefilled(backend, tokens(8, seed=8))
    with pytest.raises(CannotTrim):
        backend.copy_state(state, 9)


# ---------------------------------------------------------------------- snapshots


@pytest.mark.parametrize("kind", ["sliding", "hybrid"])
def test_a_snapshot_copies_only_the_layers_that_cannot_be_trimmed(
    backends: dict[str, MlxBackend], kind: str
) -> None:
    backend = backends[kind]
    state = prefilled(backend, tokens(200, seed=9), chunk=64)
    snapshot = backend.snapshot(state)
    assert snapshot.length == 200
    full_attention = {i for i, c in enumerate(state.caches) if type(c) is mlx_cache.KVCache}
    assert full_attention, "a mixed model has full-attention layers"
    assert snapshot.layers, "and layers that cannot be trimmed"
    assert not full_attention & set(snapshot.layers)
    assert snapshot.nbytes == sum(int(c.nbytes) for c in snapshot.layers.values())
    for layer in snapshot.layers.values():
        if isinstance(layer, mlx_cache.RotatingKVCache):  # a window, not window + chunk
            assert layer.keys.shape[2] == layer.max_size == SLIDING_WINDOW
    # The full-attention KV (what grows with the prompt) is what a snapshot leaves out.
    assert snapshot.nbytes < backend.state_nbytes(state) // 2


def test_a_snapshot_of_an_all_trimmable_model_is_empty(backends: dict[str, MlxBackend]) -> None:
    backend = backends["llama"]
    snapshot = backend.snapshot(prefilled(backend, tokens(20, seed=9)))
    assert (snapshot.layers, snapshot.nbytes) == ({}, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_restoring_at_a_snapshot_continues_like_a_cold_prefill(
    backends: dict[str, MlxBackend], kind: str
) -> None:
    """The engine's checkpoint path: trimmable layers cut back, the others from the snapshot."""
    backend = backends[kind]
    shared = tokens(45, seed=10)  # past the sliding window (32)
    first = shared + tokens(30, seed=11)
    entry = backend.new_state()
    snapshots = {}
    for end in (20, 45, len(first)):  # chunks that land on the snapshot points
        backend.prefill(entry, first[entry.length : end])
        if end < len(first):
            snapshots[end] = backend.snapshot(entry)
    # A chunk after the restore (a multi-token update), and a single token (the in-place one).
    for second in (shared + tokens(20, seed=12), shared + tokens(1, seed=13)):
        cold = greedy(backend, prefilled(backend, second), 6)
        for k, snapshot in snapshots.items():
            copy = backend.copy_state(entry, k, snapshot)
            assert copy.length == k
            backend.prefill(copy, second[k:])
            assert greedy(backend, copy, 6) == cold, f"restored at {k}, then {len(second) - k}"
    # Restoring never changed the entry (it is shared by every later hit).
    assert greedy(backend, entry, 4) == greedy(backend, prefilled(backend, first), 4)
    with pytest.raises(CannotTrim):  # a snapshot restores only the length it was taken at
        backend.copy_state(entry, 44, snapshots[45])


@pytest.mark.parametrize("kind", KINDS)
def test_snapshots_inside_a_chunk_restore_like_cold_prefills(
    backends: dict[str, MlxBackend], kind: str
) -> None:
    """The engine hands a chunk's checkpoints to prefill: a sliding window reaches back inside
    the chunk, a recurrent state ends its passes there; the long last chunk's final token (kept
    logits) runs apart."""
    backend = backends[kind]
    prompt = tokens(115, seed=14)
    entry = backend.new_state()
    inside = {(0, 30): [20], (30, 115): [45, 100, 114]}  # 85 tokens: the last one runs apart
    snapshots = {}
    for (start, end), points in inside.items():
        last = end == len(prompt)
        # With a stop flag never set, as the engine passes its abort flag: the layers are hooked.
        stop = threading.Event()
        taken = backend.prefill(
            entry, prompt[start:end], logits=last, snapshot_at=points, stop=stop
        )
        assert [s.length for s in taken] == points
        snapshots.update(zip(points, taken, strict=True))
    assert greedy(backend, entry, 4) == greedy(backend, prefilled(backend, prompt), 4)
    for k, snapshot in snapshots.items():
        second = prompt[:k] + tokens(12, seed=15)
        copy = backend.copy_state(entry, k, snapshot)
        backend.prefill(copy, second[k:])
        assert greedy(backend, copy, 6) == greedy(backend, prefilled(backend, second), 6), k
    with pytest.raises(RuntimeError):  # a chunk that kept no logits has none to sample
        backend.logits(prefilled(backend, prompt[:20], logits=False))


class _StopAfter(threading.Event):
    """Reads as set from its ``checks``-th look on: an abort landing inside a forward pass."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.left, self.seen = checks, 0

    def is_set(self) -> bool:
        self.seen += 1
        return self.seen >= self.left


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("checks", [1, 2, 3])
def test_an_interrupted_prefill_leaves_the_state_as_before(
    backends: dict[str, MlxBackend], kind: str, checks: int
) -> None:
    backend = backends[kind]
    prompt = tokens(120, seed=16)  # past the sliding window, with a last token run apart
    state = prefilled(backend, prompt[:50], logits=False)
    stop = _StopAfter(checks)
    with pytest.raises(PrefillInterrupted):
        backend.prefill(state, prompt[50:], snapshot_at=[60, 119], stop=stop)
    assert stop.seen == checks  # it stopped at the first check that found the flag set
    assert state.length == 50
    backend.prefill(state, prompt[50:])
    assert greedy(backend, state, 6) == greedy(backend, prefilled(backend, prompt), 6)
    # Not stopped: the hooks are gone once the call returns, and the state is the same.
    again = prefilled(backend, prompt[:50], logits=False)
    backend.prefill(again, prompt[50:], stop=threading.Event())
    assert not any("update_and_fetch" in vars(c) for c in again.caches)
    assert greedy(backend, again, 6) == greedy(backend, prefilled(backend, prompt), 6)


# ---------------------------------------------------------------------- teardown


def _settled_active_memory() -> int:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    return int(mx.get_active_memory())


@pytest.mark.parametrize("kind", KINDS)
def test_close_returns_the_memory(kind: TinyModelKind) -> None:
    baseline = _settled_active_memory()
    backend = load(kind)
    state = prefilled(backend, tokens(200, seed=9), chunk=64)
    greedy(backend, state, 3)
    loaded = int(mx.get_active_memory())
    assert loaded > baseline + 100_000  # weights (~3 MB fp32) and cache are really counted
    backend.close()
    del state, backend
    after = _settled_active_memory()
    margin = max(1 << 20, baseline // 20)
    assert after - baseline <= margin, f"{after - baseline} bytes still active after close()"


# ---------------------------------------------------------------------- load errors


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hf_constants

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True, raising=False)


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("path", ["nonexistent-org/nonexistent-model", "/nonexistent/model/dir"])
def test_a_model_that_is_not_local_fails_without_downloading(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.file_download as file_download

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a network call was attempted: {args} {kwargs}")

    monkeypatch.setattr(file_download, "get_session", no_network, raising=False)
    with pytest.raises(ModelLoadFailed) as caught:
        MlxBackend.load(ModelSpec(name="missing", path=path, backend="mlx"))
    message = str(caught.value)
    assert path in message
    assert "never downloads" in message


def test_an_empty_model_directory_fails_to_load(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadFailed):
        MlxBackend.load(ModelSpec(name="empty", path=str(tmp_path), backend="mlx"))
