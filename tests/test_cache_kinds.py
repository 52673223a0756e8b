"""The cache-kind adapters (``runtime.backends.mlx.cache_kinds``) on the architectures whose cache
classes only they serve: falcon_h1 and baichuan_m1 (a ``CacheList`` per layer: a convolution
state beside full or sliding attention) and llama4 (``ChunkedKVCache`` beside ``KVCache``).

Tiny random-weight builds (``runtime.testing.arch_models``): a request is served and its greedy
output equals a plain mlx-lm forward loop's; reuse (an exact repeat, an extension) equals cold;
each kind's snapshot, restore and copy round-trip (restored and continued equals a continuous
run); an interrupted pass leaves the state as before. And a cache class with no adapter is
refused at load, naming the class and the architecture.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from runtime.backends.contract import (
    CannotTrim,
    Capability,
    PrefillInterrupted,
    ReuseStrategy,
)
from runtime.backends.mlx.backend import MlxBackend, MlxState
from runtime.backends.mlx.batch import DecodeBatch
from runtime.backends.mlx.cache_kinds import KINDS, kind_of
from runtime.errors import UnsupportedCache
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Finished, ModelSpec
from runtime.testing.arch_models import arch_model_path
from runtime.testing.harness import engine_stats
from tests.loop_checks import LoopBackend, on_uvloop


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


CHUNK = 32  # llama4's attention chunk, and the sliding window of baichuan_m1's first layer
# The generic tiny builds (runtime.testing.arch_models), with the sizes these tests count on
# pinned: falcon_h1 has a CacheList(ArraysCache (mamba conv + SSM state), KVCache) per layer (two
# layers: on the generic four a test prompt meets a near tie, which raw_greedy refuses);
# baichuan_m1 CacheList(ArraysCache, RotatingKVCache(CHUNK)) on layer 0 and a plain KVCache
# beside the ArraysCache on the others; llama4 ChunkedKVCache(CHUNK) on layers 0-2, KVCache on 3.
OVERRIDES: dict[str, dict[str, Any] | None] = {
    "falcon_h1": {"num_hidden_layers": 2},
    "baichuan_m1": {"sliding_window": CHUNK, "sliding_window_layers": [0]},
    "llama4": {"text_config": {"attention_chunk_size": CHUNK, "no_rope_layers": [1, 1, 1, 0]}},
}
ARCHS = tuple(OVERRIDES)
MAX_TOKENS = 8


def spec(arch: str, name: str | None = None, chunk: int = 256, **options: Any) -> ModelSpec:
    path = str(arch_model_path(arch, overrides=OVERRIDES[arch]))
    return ModelSpec(
        name=name or arch, path=path, backend="mlx", prefill_chunk_tokens=chunk, options=options
    )


@pytest.fixture(scope="module")
def backends() -> dict[str, MlxBackend]:
    return {arch: MlxBackend.load(spec(arch)) for arch in ARCHS}


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


@functools.cache
def raw_model(arch: str) -> Any:
    from mlx_lm import load

    return load(str(arch_model_path(arch, overrides=OVERRIDES[arch])))[0]


def raw_greedy(arch: str, prompt: Sequence[int], n: int) -> list[int]:
    """Greedy tokens of a plain mlx-lm forward loop over mlx-lm's own fresh cache."""
    model = raw_model(arch)
    cache = mlx_cache.make_prompt_cache(model)
    logits = model(mx.array([list(prompt)]), cache=cache)[0, -1]
    out: list[int] = []
    for _ in range(n):
        top2 = mx.sort(logits)[-2:]
        assert float(top2[1] - top2[0]) > 1e-3, "a near tie would decide this test"
        out.append(int(mx.argmax(logits).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def prefilled(
    backend: MlxBackend, ids: Sequence[int], chunk: int | None = None, logits: bool = True
) -> MlxState:
    state = backend.new_state()
    step = chunk or len(ids)
    for start in range(0, len(ids), step):
        backend.prefill(state, ids[start : start + step], logits=logits)
    return state


def greedy(backend: MlxBackend, state: MlxState, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(int(mx.argmax(backend.logits(state)).item()))
        backend.prefill(state, [out[-1]])
    return out


# ---------------------------------------------------------------------- the registry


def test_every_cache_class_of_mlx_lm_has_an_adapter() -> None:
    """Each per-sequence cache class in mlx_lm/models/cache.py (the batched ones are what the
    adapters' kinds merge into, never a model's own cache)."""
    classes = {
        obj
        for name, obj in vars(mlx_cache).items()
        if isinstance(obj, type)
        and issubclass(obj, mlx_cache._BaseCache)
        and obj is not mlx_cache._BaseCache
        and not name.startswith("Batch")
    }
    assert classes >= {mlx_cache.CacheList, mlx_cache.ChunkedKVCache}
    assert classes - set(KINDS) == set()


@pytest.mark.parametrize(
    ("arch", "described"),
    [
        ("falcon_h1", "CacheList(ArraysCache, KVCache)"),
        ("baichuan_m1", "CacheList(ArraysCache, RotatingKVCache (window 32))"),
        ("llama4", "ChunkedKVCache (chunk 32)"),
    ],
)
def test_info_names_the_kinds_and_prices_them(
    backends: dict[str, MlxBackend], arch: str, described: str
) -> None:
    backend = backends[arch]
    info = backend.info
    assert info.reuse is ReuseStrategy.CHECKPOINT
    assert described in info.reuse_reason
    assert info.stop_checks > 0  # every layer can be put back after an interrupted pass
    # The estimate covers what the cache really holds (to 10%), and at the engine's chunks is
    # that; passes of up to a step (mlx-lm's 256): a longer one grows a chunked cache more.
    for n in (20, 100, 300):
        for chunk in (16, min(n, 256)):
            # No logits: a ring then holds window - 1 + chunk tokens, the most it ever holds.
            state = prefilled(backend, tokens(n), chunk=chunk, logits=False)
            actual = backend.state_nbytes(state)
            estimate = info.kv_bytes(n, chunk_tokens=chunk)
            assert estimate >= 0.9 * actual, (n, chunk, estimate, actual)
            if chunk == 16:
                assert estimate <= 1.1 * actual, (n, chunk, estimate, actual)
    assert info.snapshot_bytes > 0


def test_batching_is_refused_only_where_mlx_lm_has_no_batched_form(
    backends: dict[str, MlxBackend],
) -> None:
    assert DecodeBatch.unsupported_reason(backends["falcon_h1"]) is None
    assert DecodeBatch.unsupported_reason(backends["baichuan_m1"]) is None
    reason = DecodeBatch.unsupported_reason(backends["llama4"]) or ""
    assert "ChunkedKVCache has no batched form" in reason


@pytest.mark.parametrize("arch", ["falcon_h1", "baichuan_m1"])
def test_a_cache_list_batches_like_each_prompt_alone(
    backends: dict[str, MlxBackend], arch: str
) -> None:
    """Prompts of different lengths prefilled together (left-padded into each child's batched
    form), then decoded in one batch, equal each alone; on falcon_h1 (no ring) the batched pass
    takes snapshots one token before each row's end and at its end (copied out of the batch
    caches, and from the row's own state), and each restores like a continuous run. (Points
    further back would cut the padded pass: mlx-lm's SSM then reads a wrong carried state now
    and then, issue 20, not this adapter's to fix.) baichuan_m1's own batched prefill is wrong
    (mlx-lm's key/value convolution takes a left-padded row's last padding token for the token
    before its first): the load probe switches it off, so its rows are prefilled alone and only
    decoded together."""
    backend = backends[arch]
    prompts = [tokens(n, seed=n) for n in (40, 75, 110)]
    assert backend.info.together_snapshot_tokens == (2048 if arch == "falcon_h1" else 0)
    states = [backend.new_state() for _ in prompts]
    if arch == "falcon_h1":
        taken = backend.prefill_together(states, prompts, [[39, 40], [74, 75], [109]])
    else:
        assert not backend.info.capable(Capability.BATCH_PREFILL)
        assert "differs from a plain run" in backend.info.limits["batch_prefill"]
        taken = [
            backend.prefill(state, prompt) for state, prompt in zip(states, prompts, strict=True)
        ]
    batch = DecodeBatch(backend)
    slots = [batch.join(state) for state in states]
    outs: list[list[int]] = [[] for _ in slots]
    logits = {slot: state.logits for slot, state in zip(slots, states, strict=True)}
    for _ in range(5):
        fed = {slot: int(mx.argmax(logits[slot]).item()) for slot in slots}
        for out, slot in zip(outs, slots, strict=True):
            out.append(fed[slot])
        logits = batch.step(fed)
    assert outs == [raw_greedy(arch, p, 5) for p in prompts]
    for state, prompt, snapshots in zip(states, prompts, taken, strict=True):
        for snapshot in snapshots:
            k = snapshot.length
            restored = backend.copy_state(state, k, snapshot)
            backend.prefill(restored, prompt[k:])
            assert greedy(backend, restored, 4) == raw_greedy(arch, prompt, 4), k


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshots_restore_like_a_continuous_run(
    backends: dict[str, MlxBackend], arch: str
) -> None:
    """Snapshots at chunk ends (``snapshot``) and inside chunks (``snapshot_at``: a chunked
    cache and a ring reach back, a recurrent state ends a pass there), past the window."""
    backend = backends[arch]
    prompt = tokens(115, seed=1)
    entry = backend.new_state()
    inside = {(0, 30): [20], (30, 100): [33, 64, 70, 99], (100, 115): []}
    snapshots = {}
    for (start, end), points in inside.items():
        taken = backend.prefill(entry, prompt[start:end], snapshot_at=points)
        assert [s.length for s in taken] == points
        snapshots.update(zip(points, taken, strict=True))
        snapshots[end] = backend.snapshot(entry)
    first = greedy(backend, entry, 4)
    assert first == raw_greedy(arch, prompt, 4)
    for k, snapshot in sorted(snapshots.items()):
        for second in (prompt[:k] + tokens(12, seed=k), prompt[:k] + tokens(1, seed=k)):
            restored = backend.copy_state(entry, k, snapshot)
            assert restored.length == k
            backend.prefill(restored, second[k:])
            assert greedy(backend, restored, 5) == raw_greedy(arch, second, 5), (k, len(second))
    # Restoring never changed the entry (the prefix cache shares it with every later hit).
    assert greedy(backend, entry, 4) == raw_greedy(arch, prompt + first, 4)


def test_a_chunked_cache_is_cut_back_until_it_drops_its_front(
    backends: dict[str, MlxBackend],
) -> None:
    backend = backends["llama4"]
    prompt = tokens(80, seed=2)
    short = prefilled(backend, prompt[:30])
    assert backend.can_trim(short)
    cut = backend.copy_state(short, 12)
    backend.prefill(cut, prompt[12:40])
    assert greedy(backend, cut, 5) == raw_greedy("llama4", prompt[:40], 5)
    # Past a chunk, a pass drops the tokens before the last chunk's worth: an earlier chunk's
    # start is gone, so neither a trim nor a snapshot reaches back there.
    long = prefilled(backend, prompt, chunk=40)
    assert not backend.can_trim(long)
    with pytest.raises(CannotTrim):
        backend.copy_state(long, 30)
    chunked = long.caches[0]
    assert chunked.start_position > 0
    with pytest.raises(CannotTrim, match="no longer holds the chunk"):
        kind_of(chunked).snapshot(chunked, long.length - 30)
    # A snapshot keeps only the chunk of its point: fewer tokens than the chunk.
    kept = kind_of(chunked).snapshot(chunked, 0)
    assert kept.start_position == 64 and kept.keys.shape[2] == 80 - 64


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("checks", [1, 2])
def test_an_interrupted_prefill_leaves_the_state_as_before(
    backends: dict[str, MlxBackend], arch: str, checks: int
) -> None:
    backend = backends[arch]
    prompt = tokens(120, seed=3)
    state = prefilled(backend, prompt[:50])
    stop = _StopAfter(checks)
    with pytest.raises(PrefillInterrupted):
        backend.prefill(state, prompt[50:], snapshot_at=[60, 119], stop=stop)
    assert stop.seen == checks and state.length == 50
    assert not any(
        "update_and_fetch" in vars(u) for c in state.caches for u in kind_of(c).updaters(c)
    )
    backend.prefill(state, prompt[50:])
    assert greedy(backend, state, 5) == raw_greedy(arch, prompt, 5)


class _StopAfter(threading.Event):
    """Reads as set from its ``checks``-th look on: an abort landing inside a forward pass."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.left, self.seen = checks, 0

    def is_set(self) -> bool:
        self.seen += 1
        return self.seen >= self.left


# ---------------------------------------------------------------------- through the runtime


@pytest.mark.anyio
@pytest.mark.parametrize("arch", ARCHS)
async def test_requests_are_served_and_reuse_equals_cold(arch: str) -> None:
    """Cold output equals raw mlx-lm's; an exact repeat and an extension reuse the cached
    prefix (prefill less than the prompt) and still equal raw mlx-lm's."""
    prompt = tokens(150, seed=5)
    cases = [
        ("cold", tokens(2, seed=7)),  # the shortest prompt
        ("cold", prompt),
        ("repeat", prompt),
        ("extend", prompt + tokens(40, seed=6)),
    ]
    model_spec = spec(arch, "warm", chunk=16, checkpoint_every_tokens=32)
    async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:
        loaded = await rt.load_model(model_spec)
        for case, ids in cases:
            before = engine_stats(rt, loaded).counters.get("prefilled_tokens", 0)
            result = await rt.complete("warm", prompt_tokens=ids, max_tokens=MAX_TOKENS)
            assert isinstance(result.terminal, Finished), result.terminal
            assert list(result.token_ids) == raw_greedy(arch, ids, MAX_TOKENS), case
            prefilled_now = engine_stats(rt, loaded).counters["prefilled_tokens"] - before
            if case == "cold":
                assert prefilled_now == len(ids)
            else:
                assert 0 < prefilled_now < len(ids) - 32, (case, prefilled_now)


# ---------------------------------------------------------------------- refusal at load


class _ForeignCache(mlx_cache.KVCache):
    """A cache class mlx-lm does not ship (a subclass is not its parent: kinds match exactly)."""


@pytest.mark.parametrize("nested", [False, True], ids=["layer", "inside-a-CacheList"])
def test_a_cache_class_without_an_adapter_is_refused_at_load(
    monkeypatch: pytest.MonkeyPatch, nested: bool
) -> None:
    from mlx_lm.models import baichuan_m1

    def make_cache(self: Any) -> list[Any]:
        def one() -> Any:
            return mlx_cache.CacheList(mlx_cache.ArraysCache(2), _ForeignCache())

        return [one() if nested else _ForeignCache() for _ in self.layers]

    monkeypatch.setattr(baichuan_m1.Model, "make_cache", make_cache)
    with pytest.raises(UnsupportedCache) as caught:
        MlxBackend.load(spec("baichuan_m1", "foreign"))
    assert caught.value.code == "unsupported_cache"
    message = str(caught.value)
    assert "_ForeignCache" in message and "'baichuan_m1'" in message
    assert "runtime/backends/mlx/cache_kinds" in message  # what to do


@pytest.mark.anyio
async def test_the_runtime_refuses_the_load_with_the_same_code(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlx_lm.models import llama4

    monkeypatch.setattr(llama4.Model, "make_cache", lambda self: [_ForeignCache()] * 4)
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        with pytest.raises(UnsupportedCache, match=r"'llama4' architecture .*_ForeignCache"):
            await rt.load_model(spec("llama4", "foreign"))
        assert "foreign" not in {m.name for m in await rt.list_models()}


def test_a_concatenating_cache_is_cut_back_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ConcatenateKVCache`` (no model makes it per layer today; afm7 makes one for a pass
    without a cache): mlx-lm's own trim only lowers its offset, so the next update would append
    after the dropped tokens; the adapter's copy cuts the arrays."""
    from mlx_lm.models import llama

    from runtime.testing.tiny_models import tiny_model_path

    path = str(tiny_model_path("llama"))
    monkeypatch.setattr(
        llama.Model,
        "make_cache",
        lambda self: [mlx_cache.ConcatenateKVCache() for _ in self.layers],
        raising=False,
    )
    backend = MlxBackend.load(ModelSpec(name="concat", path=path, backend="mlx"))
    assert backend.info.reuse is ReuseStrategy.TRIM
    assert "ConcatenateKVCache has no batched form" in (
        DecodeBatch.unsupported_reason(backend) or ""
    )
    prompt = tokens(60, seed=8)
    state = prefilled(backend, prompt)
    cut = backend.copy_state(state, 25)
    backend.prefill(cut, prompt[25:40])
    monkeypatch.undo()  # the reference: the same weights over mlx-lm's ordinary KVCache
    from mlx_lm import load

    model = load(path)[0]
    cache = mlx_cache.make_prompt_cache(model)
    logits = model(mx.array([prompt[:40]]), cache=cache)[0, -1]
    assert int(mx.argmax(backend.logits(cut)).item()) == int(mx.argmax(logits).item())
    assert mx.allclose(backend.logits(cut), logits.astype(mx.float32), atol=1e-4).item()


def test_a_verdict_is_cached_per_cache_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's verdict depends on the cache classes the layers get: a load whose classes a
    host swapped is probed on its own and never hands its verdict to the plain model (a test
    that swapped the tiny llama's caches once turned batching off for every later test)."""
    from mlx_lm.models import llama

    from runtime.testing.tiny_models import tiny_model_path

    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx")
    monkeypatch.setattr(
        llama.Model,
        "make_cache",
        lambda self: [mlx_cache.ConcatenateKVCache() for _ in self.layers],
        raising=False,
    )
    swapped = MlxBackend.load(spec).info
    assert "batch_decode" in swapped.limits
    monkeypatch.undo()
    plain = MlxBackend.load(spec).info
    assert plain.limits == {}
