"""Fresh prompts prefilled together in one batched pass (``Backend.prefill_together``): the MLX
backend's rows equal prompts prefilled one by one on every cache kind, and the engine groups a
burst of newcomers' whole prompts (and nothing else) into one job."""

from __future__ import annotations

from collections.abc import Sequence as Ordered

import mlx.core as mx
import pytest

from actors.engine.jobs import StepJob, TogetherJob, run_together
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import SequenceState, Snapshot
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.simulated import greedy_continuation
from runtime.messages import Admit, Failed, ModelSpec, Started
from runtime.testing.harness import ModelOption, engine, kv_keeper, make_sim, prefix_cache, sim_spec
from runtime.testing.requests import generate, prewarm
from runtime.testing.simulator import Simulator
from runtime.testing.tiny_models import TINY_MODEL_KINDS, TinyModelKind, tiny_model_path

# --------------------------------------------------------------------------- the MLX backend


def _greedy(backend: MlxBackend, state: SequenceState, steps: int) -> list[int]:
    tokens, logits = [], backend.logits(state)
    for _ in range(steps):
        token = mx.argmax(logits).item()
        assert isinstance(token, int)
        tokens.append(token)
        logits = backend.feed(state, mx.array(token)).reshape(-1)
    return tokens


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_rows_prefilled_together_equal_prompts_prefilled_one_by_one(kind: TinyModelKind) -> None:
    backend = MlxBackend.load(ModelSpec(name="m", path=str(tiny_model_path(kind))))
    # Of different lengths (padding), one past the sliding model's window.
    prompts = [list(range(5, 5 + n)) for n in (7, 40, 2, 19)]
    alone = [backend.new_state() for _ in prompts]
    for state, prompt in zip(alone, prompts, strict=True):
        backend.prefill(state, prompt)
    together = [backend.new_state() for _ in prompts]
    backend.prefill_together(together, prompts)
    for one, row, prompt in zip(alone, together, prompts, strict=True):
        assert row.length == len(prompt)
        assert mx.allclose(backend.logits(one), backend.logits(row), atol=1e-4).item()
        assert _greedy(backend, row, 8) == _greedy(backend, one, 8)


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_rows_with_cached_prefixes_equal_their_prompts_prefilled_alone(kind: TinyModelKind) -> None:
    # States restored from the prefix cache hold prefixes of different lengths (one none, one
    # past the sliding model's window of 32).
    backend = MlxBackend.load(ModelSpec(name="m", path=str(tiny_model_path(kind))))
    prompts = [list(range(5, 5 + n)) for n in (12, 30, 9, 20, 47)]
    cached = (5, 17, 0, 1, 40)
    alone, together = [], []
    for prompt, k in zip(prompts, cached, strict=True):
        one = backend.new_state()
        backend.prefill(one, prompt)
        alone.append(one)
        row = backend.new_state()
        if k:
            backend.prefill(row, prompt[:k])
        together.append(row)
    backend.prefill_together(together, [p[k:] for p, k in zip(prompts, cached, strict=True)])
    for one, row, prompt in zip(alone, together, prompts, strict=True):
        assert row.length == len(prompt)
        assert mx.allclose(backend.logits(one), backend.logits(row), atol=1e-4).item()
        assert _greedy(backend, row, 8) == _greedy(backend, one, 8)


def test_prefill_together_takes_two_tokens_or_more_per_state() -> None:
    backend = MlxBackend.load(ModelSpec(name="m", path=str(tiny_model_path("llama"))))
    with pytest.raises(ValueError, match="2 tokens or more"):
        backend.prefill_together([backend.new_state()], [[4]])


@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_snapshots_taken_in_a_batched_pass_restore_like_those_of_a_prefill(
    kind: TinyModelKind,
) -> None:
    # Points in the middle (the hybrid model's pass is cut there), one before the end (between
    # the padded pass and the last tokens'), at the end; states with cached prefixes, one past
    # the sliding model's 32-token window, and a prompt that ends past it.
    backend = MlxBackend.load(ModelSpec(name="m", path=str(tiny_model_path(kind))))
    prompts = [list(range(7, 7 + n)) for n in (20, 9, 31, 24, 70, 50)]
    cached = (0, 0, 0, 6, 40, 0)
    points = [[5, 19], [8, 9], [3, 16, 30], [10, 23], [45, 60, 69, 70], [12, 48, 49]]
    assert all(len(p) <= backend.info.together_snapshot_tokens for p in prompts)
    together = [backend.new_state() for _ in prompts]
    for row, prompt, k in zip(together, prompts, cached, strict=True):
        if k:
            backend.prefill(row, prompt[:k])
    rests = [p[k:] for p, k in zip(prompts, cached, strict=True)]
    taken = backend.prefill_together(together, rests, points)
    for row, prompt, at, snapshots in zip(together, prompts, points, taken, strict=True):
        alone = backend.new_state()
        expected = backend.prefill(alone, prompt, snapshot_at=at)
        assert [s.length for s in snapshots] == at
        for point, mine, theirs in zip(at, snapshots, expected, strict=True):
            suffix = [90, 91, 92]
            restored = backend.copy_state(row, point, mine)
            reference = backend.copy_state(alone, point, theirs)
            backend.prefill(restored, suffix)
            backend.prefill(reference, suffix)
            assert mx.allclose(
                backend.logits(restored), backend.logits(reference), atol=1e-4
            ).item(), (point, len(prompt))


def test_every_cache_kind_mlx_lm_batches_snapshots_any_prompt_in_a_batched_pass() -> None:
    for kind in TINY_MODEL_KINDS:
        backend = MlxBackend.load(ModelSpec(name="m", path=str(tiny_model_path(kind))))
        assert backend.info.together_snapshot_tokens == backend.info.context_length, kind
        with pytest.raises(ValueError, match="outside"):
            backend.prefill_together([backend.new_state()], [[4, 5, 6]], [[4]])


# --------------------------------------------------------------------------- the job


class _Recorder:
    """A backend stand-in that records what ``prefill_together`` was given."""

    def __init__(self, error: Exception | None = None) -> None:
        self.prompts: list[list[int]] = []
        self.error = error

    def prefill_together(
        self,
        states: Ordered[SequenceState],
        prompts: Ordered[Ordered[int]],
        snapshot_at: Ordered[Ordered[int]] = (),
    ) -> Ordered[Ordered[Snapshot]]:
        if self.error is not None:
            raise self.error
        self.prompts = [list(p) for p in prompts]
        return [[] for _ in prompts]


class _Empty:
    length = 0


def _prefilling(seq_id: int, prompt: tuple[int, ...]) -> Sequence:
    request = generate(f"r{seq_id}", None, 4)
    seq = Sequence.admitted(Admit(sequence_id=seq_id, epoch=1, session="s", request=request), "m")
    seq.tokens, seq.phase = prompt, Phase.PREFILLING
    seq.state = _Empty()
    return seq


def test_a_member_aborted_before_the_pass_is_left_out_and_a_failure_fails_the_others() -> None:
    seqs = [_prefilling(i, tuple(range(i, i + 5))) for i in range(1, 4)]
    seqs[1].abort.set()
    job = TogetherJob([StepJob(s) for s in seqs])
    recorder = _Recorder()
    run_together(job, recorder)  # type: ignore[arg-type]
    assert recorder.prompts == [list(seqs[0].tokens or ()), list(seqs[2].tokens or ())]
    assert [s.skipped for s in job.steps] == [False, True, False]
    assert [s.prefilled for s in job.steps] == [5, 0, 5]
    failing = TogetherJob([StepJob(s) for s in seqs])
    run_together(failing, _Recorder(RuntimeError("boom")))  # type: ignore[arg-type]
    assert [type(s.error) for s in failing.steps] == [RuntimeError, type(None), RuntimeError]


# --------------------------------------------------------------------------- in the engine


def _spec(**options: ModelOption) -> ModelSpec:
    return sim_spec(chunk=32, prefill_s_per_token=0.001, decode_s_per_token=0.001, **options)


def _send(sim: Simulator, request_id: str, prompt: tuple[int, ...], n: int = 4) -> None:
    sim.send(generate(request_id, prompt, n))


def test_a_burst_of_fresh_prompts_is_prefilled_in_one_job_and_outputs_stay_exact() -> None:
    sim = make_sim(_spec())
    prompts = {f"r{i}": tuple(range(10 * i, 10 * i + 5 + i)) for i in range(1, 5)}
    prompts["long"] = tuple(range(100, 160))  # past one chunk: prefilled on its own, in chunks
    for rid, prompt in prompts.items():
        _send(sim, rid, prompt)
    sim.send(prewarm("w", (7, 8, 9, 10)))
    sim.run_until_quiescent()
    for rid, prompt in prompts.items():
        assert sim.emitted_tokens(rid, 1) == greedy_continuation(prompt, 4)
    counters = engine(sim).counters.snapshot()
    assert counters["prefills_together"] == 1
    assert counters["prefilled_tokens"] == sum(len(p) for p in prompts.values()) + 3
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_without_batching_every_prompt_is_prefilled_on_its_own() -> None:
    sim = make_sim(_spec(batching=False))
    for i in range(1, 4):
        _send(sim, f"r{i}", tuple(range(10 * i, 10 * i + 6)))
    sim.run_until_quiescent()
    assert engine(sim).counters.snapshot().get("prefills_together", 0) == 0


def test_a_fault_in_a_prefill_together_fails_each_member_retryably_and_leaks_nothing() -> None:
    sim = make_sim(_spec(fail_prefill_call=1))
    for i in range(1, 4):
        _send(sim, f"r{i}", tuple(range(10 * i, 10 * i + 6)))
    sim.run_until_quiescent()
    for i in range(1, 4):
        failed = sim.terminal(f"r{i}", 1)
        assert isinstance(failed, Failed) and failed.code == "backend_error" and failed.retryable
    _send(sim, "after", (1, 2, 3))
    sim.run_until_quiescent()
    assert sim.emitted_tokens("after", 1) == greedy_continuation((1, 2, 3), 4)
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_prompts_with_checkpoints_are_prefilled_together_and_the_checkpoints_serve_reuse() -> None:
    # An untrimmable cache: each prompt plans checkpoints, which the batched pass takes.
    sim = make_sim(_spec(trimmable=False))
    prompts = {f"r{i}": tuple(range(10 * i, 10 * i + 12)) for i in range(1, 4)}
    for rid, prompt in prompts.items():
        _send(sim, rid, prompt)
    sim.run_until_quiescent()
    counters = engine(sim).counters.snapshot()
    assert counters["prefills_together"] == 1
    for rid, prompt in prompts.items():
        assert sim.emitted_tokens(rid, 1) == greedy_continuation(prompt, 4)
    # The prompt with its last token changed: restored from its end-minus-one checkpoint.
    edited = (*prompts["r2"][:-1], 200)
    _send(sim, "edited", edited)
    sim.run_until_quiescent()
    (start,) = [e for e in sim.events("edited", 1) if isinstance(e, Started)]
    assert start.cached_tokens == len(edited) - 1
    assert sim.emitted_tokens("edited", 1) == greedy_continuation(edited, 4)
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


@pytest.mark.parametrize("trimmable", [True, False])
def test_prompts_that_restored_a_cached_prefix_are_prefilled_together(trimmable: bool) -> None:
    sim = make_sim(_spec(trimmable=trimmable))
    shared = tuple(range(40, 52))
    _send(sim, "first", (*shared, 1, 2, 3))
    sim.run_until_quiescent()
    prompts = {f"r{i}": (*shared, 1, 2, 3, *range(10 * i, 10 * i + 4 + i)) for i in range(1, 4)}
    for rid, prompt in prompts.items():
        _send(sim, rid, prompt)
    sim.run_until_quiescent()
    assert engine(sim).counters.snapshot()["prefills_together"] == 1
    for rid, prompt in prompts.items():
        (start,) = [e for e in sim.events(rid, 1) if isinstance(e, Started)]
        assert start.cached_tokens > 0
        assert sim.emitted_tokens(rid, 1) == greedy_continuation(prompt, 4)
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes
