"""The load probe and the workarounds for mlx-lm's batching defects, on tiny random-weight builds
(``runtime.testing.arch_models``) of the architectures mlx-lm batches wrongly (mamba2, nemotron_h,
rwkv7, gemma2; gpt_bigcode, afm7 and nemotron-nas from the architecture matrix's builds)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import httpx
import mlx.core as mx
import pytest

import runtime.backends.mlx.backend as mlx_backend
import runtime.backends.mlx.capabilities as capabilities
import runtime.backends.mlx.probe as probe
import runtime.backends.mlx.together as together
from runtime.backends.contract import CannotTrim, Capability, ReuseStrategy, Verdict
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.mlx.probe import Declared, ProbeResult, plain_run, probe_prompts, run_probe
from runtime.backends.mlx.state import MlxState
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelLoaded, ModelSpec, TokensEmitted
from runtime.server import OpenAIServer, ServerConfig
from runtime.server.stats_collector import RuntimeCollector
from runtime.testing.arch_models import arch_model_path
from runtime.testing.harness import engine_stats
from runtime.testing.tiny_models import TinyModelKind, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


# Four prompts of different lengths: a batched prefill pads every row differently.
PROMPTS = tuple(tuple(5 + (7 * i + 3 + 29 * row) % 480 for i in range(n)) for row, n in
                enumerate((11, 23, 37, 52)))  # fmt: skip
MAX_TOKENS = 10
# The generic tiny builds, with what a test counts on pinned: gemma2's two KV heads, as many as
# the probe's batch has rows, are what turns its unpatched batching into a silent broadcast
# across heads (a wrong output, not a crash).
OVERRIDES: dict[str, dict[str, Any] | None] = {
    "mamba2": None,
    "nemotron_h": None,
    "rwkv7": None,
    "gemma2": {"num_key_value_heads": 2},
}
ARCHS = tuple(OVERRIDES)


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test probes afresh: verdicts are cached under the runtime's cache dir."""
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def arch_path(arch: str) -> Path:
    return arch_model_path(arch, overrides=OVERRIDES[arch])


def spec_of(arch: str) -> ModelSpec:
    return ModelSpec(name=arch, path=str(arch_path(arch)), backend="mlx")


async def greedy(rt: Runtime, model: str, prompt: tuple[int, ...]) -> list[int]:
    async with rt.generate(model, prompt_tokens=prompt, max_tokens=MAX_TOKENS) as stream:
        return [t async for e in stream if isinstance(e, TokensEmitted) for t in e.token_ids]


async def solo_then_together(rt: Runtime, model: str) -> tuple[list[list[int]], list[list[int]]]:
    alone = [await greedy(rt, model, p) for p in PROMPTS]
    await rt.reset(model)
    together: list[list[int]] = [[] for _ in PROMPTS]

    async def one(index: int) -> None:
        together[index] = await greedy(rt, model, PROMPTS[index])

    async with anyio.create_task_group() as tg:
        for index in range(len(PROMPTS)):
            tg.start_soon(one, index)
    return alone, together


@pytest.mark.parametrize("arch", ARCHS)
async def test_four_concurrent_streams_give_each_its_solo_greedy_output(arch: str) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec_of(arch))
        assert "batch_decode" not in loaded.limits and "batch_prefill" not in loaded.limits
        alone, together = await solo_then_together(rt, arch)
        counters = engine_stats(rt, loaded).counters
    assert together == alone
    assert len({tuple(t) for t in alone}) == len(PROMPTS)  # the output depends on the prompt
    # Both batched paths ran: the workarounds were exercised, not bypassed.
    assert counters["prefills_together"] > 0 and counters["batch_steps"] > 0


def test_the_probe_finds_each_batched_path_exact_with_the_workarounds() -> None:
    for arch in ARCHS:
        info = MlxBackend.load(spec_of(arch)).info
        for capability in (Capability.BATCH_PREFILL, Capability.BATCH_DECODE):
            assert info.capable(capability), (arch, info.limits)
        verdicts = {v.capability: v for v in info.capabilities}
        assert verdicts[Capability.BATCH_PREFILL].max_diff is not None
        assert verdicts[Capability.BATCH_PREFILL].max_diff < 1e-3


async def test_a_broken_capability_is_switched_off_and_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without its workaround gemma2's attention cannot take a per-row mask: both batched paths
    # go wrong on it, so the probe must switch them off and the streams go one at a time.
    monkeypatch.setattr(mlx_backend, "patch_model", lambda model: ())
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec_of("gemma2"))
        assert isinstance(loaded, ModelLoaded)
        assert set(loaded.limits) == {"batch_decode", "batch_prefill"}
        # A crash (broadcast_shapes), or, where the batch has as many rows as the model has KV
        # heads, a silent broadcast across heads: the probe's two rows meet the latter.
        assert "differs from a plain run" in loaded.limits["batch_decode"]
        (status,) = [s for s in await rt.list_models() if s.name == "gemma2"]
        assert status.limits == loaded.limits  # what GET /v1/models shows
        alone, together = await solo_then_together(rt, "gemma2")
        stats = engine_stats(rt, loaded)
        families = {f.name: f for f in RuntimeCollector(rt.stats).collect()}
    assert together == alone
    assert stats.counters.get("batch_steps", 0) == 0
    assert stats.counters.get("prefills_together", 0) == 0
    assert stats.gauges["capability_batch_decode"] == 0 and stats.gauges["capability_trim"] == 1
    assert stats.limits == loaded.limits
    samples = {s.labels["capability"]: s.value for s in families["mlxrt_model_capability"].samples}
    assert samples["batch_decode"] == 0 and samples["batch_prefill"] == 0 and samples["trim"] == 1


def test_a_second_load_takes_the_cached_verdict_and_runs_no_probe(
    monkeypatch: pytest.MonkeyPatch, own_cache_dir: Path
) -> None:
    runs: list[str] = []
    real = capabilities.run_probe

    def counted(backend: MlxBackend, *args: Any) -> Any:
        runs.append("ran")
        return real(backend, *args)

    monkeypatch.setattr(capabilities, "run_probe", counted)
    first = MlxBackend.load(spec_of("mamba2")).info
    second = MlxBackend.load(spec_of("mamba2")).info
    assert runs == ["ran"]
    assert not first.probe_cached and second.probe_cached
    assert second.capabilities == first.capabilities
    assert len(list((own_cache_dir / "probe").glob("*.json"))) == 1
    # A changed model (here its weights file's time) is another fingerprint: probed again.
    weights = next(arch_path("mamba2").glob("*.safetensors"))
    stat = weights.stat()
    try:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        assert not MlxBackend.load(spec_of("mamba2")).info.probe_cached
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert runs == ["ran", "ran"]


async def test_the_model_card_and_metrics_say_what_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlx_backend, "patch_model", lambda model: ())  # gemma2 batching is wrong
    runtime = RuntimeConfig(kv_budget_bytes=1 << 28)
    config = ServerConfig(models=(spec_of("gemma2"),), runtime=runtime, offer_cached_models=False)
    server = OpenAIServer(config)
    async with server.app.router.lifespan_context(server.app):
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            card = (await client.get("/v1/models/gemma2")).json()
            metrics = (await client.get("/metrics")).text
    assert set(card["limits"]) == {"batch_decode", "batch_prefill"}
    assert "differs from a plain run" in card["limits"]["batch_decode"]
    assert 'mlxrt_model_capability{capability="batch_decode",model="gemma2"} 0.0' in metrics
    assert 'mlxrt_model_capability{capability="trim",model="gemma2"} 1.0' in metrics


def test_where_trimming_proved_wrong_reuse_restores_whole_checkpoints() -> None:
    # No architecture here trims wrongly; the verdict is given, and the fallback it selects is
    # checked for exactness on a real (tiny) model.
    backend = MlxBackend.load(ModelSpec(name="llama", path=str(tiny_model_path("llama"))))
    found = ProbeResult(
        verdicts=(Verdict(capability=Capability.TRIM, on=False, why="given"),),
        checkpoints_exact=True,
        seconds=0.0,
    )
    caches = backend.new_state().caches
    info = capabilities.apply_verdict(backend, backend.info, caches, found, from_cache=True)
    assert info.reuse is ReuseStrategy.CHECKPOINT and info.limits == {"trim": "given"}
    prompt = list(PROMPTS[2])
    full = backend.new_state()
    (snapshot,) = backend.prefill(full, prompt, snapshot_at=[20])
    assert len(snapshot.layers) == len(caches)  # every layer copied, none cut back
    assert not backend.can_trim(full)
    with pytest.raises(CannotTrim):
        backend.copy_state(full, 20)
    restored = backend.copy_state(full, 20, snapshot)
    backend.prefill(restored, prompt[20:])
    assert mx.allclose(backend.logits(restored), backend.logits(full), atol=1e-4).item()
    # A batched prefill takes whole snapshots too (its passes cut at the points).
    states = [backend.new_state(), backend.new_state()]
    taken = backend.prefill_together(states, [prompt[:30], prompt[:12]], [[7, 29], [5]])
    for row_snapshots in taken:
        assert all(len(s.layers) == len(caches) for s in row_snapshots)
    again = backend.copy_state(states[0], 7, taken[0][0])
    backend.prefill(again, prompt[7:30])
    assert mx.allclose(backend.logits(again), backend.logits(states[0]), atol=1e-4).item()


@pytest.mark.parametrize("arch", ["mamba2", "rwkv7"])
def test_without_the_recurrent_workarounds_the_probe_forbids_batched_prefill(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mlx-lm's own padded pass: mamba2's SSM reads a cut piece's state past its end, rwkv7 runs
    # the padding through its recurrence.
    monkeypatch.setattr(together, "piece_lengths", lambda *args: None)
    monkeypatch.setattr(together, "put_rows", lambda *args: None)
    backend = MlxBackend.load(spec_of(arch))
    assert not backend.info.capable(Capability.BATCH_PREFILL)
    assert "differs from a plain run" in backend.info.limits["batch_prefill"]
    assert backend.info.capable(Capability.BATCH_DECODE)  # no padding in a recurrent decode step


@pytest.mark.parametrize("arch", ["mamba2", "gemma2"])  # a checkpoint model, a trimming one
def test_the_load_warm_up_is_the_probes_first_plain_run(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[tuple[Declared, MlxState | None]] = []
    real = run_probe

    def kept(backend: MlxBackend, declared: Declared, vocab: int, first: Any = None) -> Any:
        given.append((declared, first))
        return real(backend, declared, vocab, first)

    monkeypatch.setattr(capabilities, "run_probe", kept)
    backend = MlxBackend.load(spec_of(arch))
    ((declared, first),) = given
    assert first is not None
    prompt = probe_prompts(backend.info.vocab_size)[0]
    # The timed passes ran on a copy: the warm-up state is the prompt's plain run, as a fresh one
    # (extended by the batched decode check's plain step, the probe's last).
    fresh = plain_run(backend, prompt)
    assert first.n_tokens == len(prompt) + 1
    backend.feed(fresh, mx.array(prompt[1]))
    assert mx.array_equal(backend.logits(first), backend.logits(fresh)).item()
    token = mx.array(prompt[2])
    assert mx.array_equal(backend.feed(first, token), backend.feed(fresh, token)).item()
    # Its verdicts are those of a probe that runs the first prompt itself.
    again = MlxBackend.load(spec_of(arch))  # the verdict cached: no probe ran in this load
    assert len(given) == 1
    alone = real(again, declared, again.info.vocab_size)
    assert [v.on for v in alone.verdicts] == [v.on for v in backend.info.capabilities]
    assert alone.checkpoints_exact


def test_a_first_run_of_another_prompt_is_refused() -> None:
    backend = MlxBackend.load(ModelSpec(name="llama", path=str(tiny_model_path("llama"))))
    declared = Declared(
        reach_back=True, checkpoints=False, trims=True, batch_refusal=None, together_points=False
    )
    prompt = probe_prompts(backend.info.vocab_size)[0]
    other = plain_run(backend, prompt[:-1])
    with pytest.raises(ValueError, match="not this probe's"):
        run_probe(backend, declared, backend.info.vocab_size, other)
    assert run_probe(backend, declared, backend.info.vocab_size, plain_run(backend, prompt))


@pytest.mark.parametrize(
    ("kind", "passes"),
    [("llama", 0), ("sliding", 0), ("hybrid", 1)],  # cut back; a ring not wrapped; recurrent
)
def test_the_batched_prefills_cached_prefix_is_the_plain_run_cut_back(
    kind: TinyModelKind, passes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = MlxBackend.load(ModelSpec(name=kind, path=str(tiny_model_path(kind))))
    info = backend.info
    declared = Declared(
        reach_back=backend.reach_back,
        checkpoints=info.reuse is ReuseStrategy.CHECKPOINT,
        trims=info.reuse is ReuseStrategy.TRIM,
        batch_refusal=None,
        together_points=False,
    )
    prompts = probe_prompts(info.vocab_size)
    base = probe._Baseline(backend, prompts, declared, None)
    ran: list[int] = []
    real = backend.prefill

    def counted(state: Any, ids: Any, **kwargs: Any) -> Any:
        ran.append(len(ids))
        return real(state, ids, **kwargs)

    monkeypatch.setattr(backend, "prefill", counted)
    prefix = probe._cached_prefix(backend, base)
    assert len(ran) == passes and prefix.n_tokens == probe._PREFIX
    monkeypatch.undo()
    backend.prefill(prefix, prompts[-1][probe._PREFIX :])
    assert mx.allclose(backend.logits(prefix), base.logits[-1], atol=1e-4).item()


@pytest.mark.parametrize(
    ("arch", "unpatched"),
    [
        # Position ids from one offset, which a batch cache has one of per row: both paths crash
        # ("[convert] Only length-1 arrays can be converted to Python scalars").
        ("gpt_bigcode", "crashed"),
        # The KV-reuse layers rotate every row's queries at the batch's padded length.
        ("afm7", "differs from a plain run"),
    ],
)
async def test_a_matrix_build_batches_exactly_with_its_workaround(
    arch: str, unpatched: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # upstream.patch_model fixes the model's batched forward, so both batched paths stay on.
    spec = ModelSpec(name=arch, path=str(arch_model_path(arch)), backend="mlx")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec)
        assert loaded.limits == {}
        alone, together = await solo_then_together(rt, arch)
        counters = engine_stats(rt, loaded).counters
    assert together == alone
    assert counters["prefills_together"] > 0 and counters["batch_steps"] > 0
    # Without it the probe switches both batched paths off.
    monkeypatch.setattr(mlx_backend, "patch_model", lambda model: ())
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(Path(os.environ["MLXRT_CACHE_DIR"]) / "unpatched"))
    limits = MlxBackend.load(spec).info.limits
    assert {"batch_decode", "batch_prefill"} <= set(limits), limits
    assert unpatched in limits["batch_decode"]


# transformers warns about the tiny config's fields as it reads them with the tokenizer.
@pytest.mark.filterwarnings("ignore::FutureWarning")
async def test_a_model_with_layers_it_never_writes_batches_exactly() -> None:
    # nemotron-nas's linear-replaced attention keeps an empty KVCache: such a layer joins, rolls
    # and leaves a batch empty, so both batched paths stay on. Before, join refused the state, a
    # padded pass crashed in mlx-lm's finalize, and restored prompts crashed in mlx-lm's merge
    # (a cut-back copy of the empty layer had a negative offset).
    spec = ModelSpec(name="nas", path=str(arch_model_path("nemotron-nas")), backend="mlx")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28)) as rt:
        loaded = await rt.load_model(spec)
        assert loaded.limits == {}
        alone, together = await solo_then_together(rt, "nas")
        # Again from the prefix cache: the prompts' states are restored, then batched.
        await rt.reset("nas")
        for prompt in PROMPTS:
            await greedy(rt, "nas", prompt[:8])
        restored: list[list[int]] = [[] for _ in PROMPTS]

        async def one(index: int) -> None:
            restored[index] = await greedy(rt, "nas", PROMPTS[index])

        async with anyio.create_task_group() as tg:
            for index in range(len(PROMPTS)):
                tg.start_soon(one, index)
        counters = engine_stats(rt, loaded).counters
    assert together == alone and restored == alone
    assert counters["prefills_together"] > 0 and counters["batch_steps"] > 0
