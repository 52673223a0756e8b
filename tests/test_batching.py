"""Continuous batching: the fast path for one stream, a shared batch for several."""

from __future__ import annotations

import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.messages import Cancel, Cancelled, Finished, FinishReason, ModelSpec
from runtime.testing.harness import (
    ModelOption,
    engine,
    kv_keeper,
    make_sim,
    prefix_cache,
    sim_spec,
)
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001


def spec(**options: ModelOption) -> ModelSpec:
    """Model "m": 8-token chunks, every token costs PER_TOKEN of virtual time."""
    return sim_spec(chunk=8, prefill_s_per_token=PER_TOKEN, decode_s_per_token=PER_TOKEN, **options)


def counters(sim: Simulator) -> dict[str, int]:
    return engine(sim).counters.snapshot()


@pytest.mark.parametrize("seed", range(5))
def test_a_running_stream_moves_into_the_batch_and_outputs_stay_exact(seed: int) -> None:
    sim = make_sim(spec(), seed=seed)
    first, second = tuple(range(10, 20)), tuple(range(30, 60))
    sim.send(generate("a", first, 40))
    sim.advance(0.02)  # "a" decodes alone on the fast path
    alone = counters(sim)
    assert alone.get("decoded_tokens", 0) > 0 and alone.get("batch_steps", 0) == 0
    sim.send(generate("b", second, 12, incarnation=2))
    sim.run_until_quiescent()
    assert sim.emitted_tokens("a", 1) == greedy_continuation(first, 40)
    assert sim.emitted_tokens("b", 2) == greedy_continuation(second, 12)
    after = counters(sim)
    assert after["batch_steps"] > 0 and after["batch_joins"] == 2
    # "b" finished first; "a" went back to the fast path for its last tokens.
    assert after["batch_leaves"] == 2
    assert after["decoded_tokens"] > alone["decoded_tokens"]
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_an_abort_removes_one_row_without_disturbing_the_others() -> None:
    sim = make_sim(spec())
    prompts = [tuple(range(i * 10, i * 10 + 6)) for i in range(1, 5)]
    for index, prompt in enumerate(prompts):
        sim.send(generate(f"r{index}", prompt, 30, incarnation=index + 1))
    sim.advance(0.05)
    assert engine(sim).statistics().gauges["batch_size"] >= 3
    sim.send(Cancel(request_id="r1", incarnation=2))
    sim.run_until_quiescent()
    cancelled = sim.terminal("r1", 2)
    assert isinstance(cancelled, Cancelled) and cancelled.reason == "cancelled"
    partial = sim.emitted_tokens("r1", 2)
    assert partial == greedy_continuation(prompts[1], 30)[: len(partial)]
    for index in (0, 2, 3):
        terminal = sim.terminal(f"r{index}", index + 1)
        assert isinstance(terminal, Finished) and terminal.reason is FinishReason.LENGTH
        assert sim.emitted_tokens(f"r{index}", index + 1) == greedy_continuation(prompts[index], 30)
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_a_long_prefill_interleaves_with_the_batch_steps() -> None:
    sim = make_sim(spec())
    sim.send(generate("a", (1, 2, 3), 60))
    sim.send(generate("b", (4, 5, 6), 60, incarnation=2))
    sim.advance(0.02)
    before = counters(sim)
    long_prompt = tuple(t % 256 for t in range(7, 400))  # ids of the simulated vocabulary
    sim.send(generate("c", long_prompt, 2, incarnation=3))  # 393 tokens: 50 chunks of 8
    sim.advance(0.2)
    during = counters(sim)
    # Chunks and batch steps take turns: the running streams get a token after every chunk.
    chunks = (during["prefilled_tokens"] - before["prefilled_tokens"]) // 8
    assert 10 < chunks < 50
    assert during["batch_steps"] - before["batch_steps"] >= chunks - 1
    sim.run_until_quiescent()
    assert sim.emitted_tokens("c", 3) == greedy_continuation(long_prompt, 2)


def test_the_admission_gate_runs_at_most_max_concurrent_and_the_rest_wait_in_order() -> None:
    sim = make_sim(spec(max_concurrent=2))
    prompts = [tuple(range(i * 10, i * 10 + 5)) for i in range(1, 6)]
    for index, prompt in enumerate(prompts):
        sim.send(generate(f"r{index}", prompt, 6, incarnation=index + 1))
    sim.advance(0.005)
    core = engine(sim)
    assert core.statistics().gauges["sequences"] == 5
    assert core.counters["admission_waits"] == 3
    sim.send(Cancel(request_id="r3", incarnation=4))  # cancelled while it waits at the gate
    sim.run_until_quiescent()
    cancelled = sim.terminal("r3", 4)
    assert isinstance(cancelled, Cancelled) and cancelled.usage.completion_tokens == 0
    for index in (0, 1, 2, 4):
        assert sim.emitted_tokens(f"r{index}", index + 1) == greedy_continuation(prompts[index], 6)
    starts = [
        next(i for i, m in enumerate(sim.host_messages) if getattr(m, "request_id", "") == rid
             and type(m).__name__ == "Started")
        for rid in ("r2", "r4")
    ]  # fmt: skip
    assert starts == sorted(starts)  # FIFO through the gate


@pytest.mark.parametrize("seed", range(3))
def test_a_burst_of_newcomers_joins_the_batch_in_one_step_on_one_padding_ask(seed: int) -> None:
    # The later newcomers' first draws are next when the first ones have drawn: the batch waits
    # for them rather than joining some now and rewriting its cache again for the rest.
    sim = make_sim(spec(), seed=seed)
    prompts = {f"r{i}": tuple(range(10 * i, 10 * i + 3 + i)) for i in range(1, 6)}
    for rid, prompt in prompts.items():
        sim.send(generate(rid, prompt, 10))
    sim.run_until_quiescent()
    for rid, prompt in prompts.items():
        assert sim.emitted_tokens(rid, 1) == greedy_continuation(prompt, 10)
    seen = counters(sim)
    assert seen["batch_padding_asks"] == 1 and seen["batch_joins"] == len(prompts)
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


@pytest.mark.parametrize("padded", [False, True])
def test_newcomers_whose_join_raises_decode_alone_and_never_spin(padded: bool) -> None:
    # A model whose states cannot join a batch (nemotron-nas's no-op attention layers keep an
    # empty KV cache): every batch step raises in join before it steps anyone. The newcomers it
    # did not take are whole, so they finish alone, exact; they must not be asked in again and
    # again (the engine once rebuilt the same failing join forever, zero time per try).
    sim = make_sim(spec(fail_join=True))
    prompts = {f"r{i}": tuple(range(10 * i, 10 * i + (3 + i if padded else 4))) for i in (1, 2, 3)}
    for rid, prompt in prompts.items():
        sim.send(generate(rid, prompt, 12))
    for _ in range(10_000):  # each event is bounded work: a livelock never gets quiescent
        if sim.quiescent:
            break
        sim.fire_next_timer()
        sim.run_until_idle()
    else:
        pytest.fail("the engine kept working without finishing: a batch join retried forever")
    for rid, prompt in prompts.items():
        assert sim.emitted_tokens(rid, 1) == greedy_continuation(prompt, 12)
    seen = counters(sim)
    assert seen["batch_join_failed"] >= 2 and seen["batch_joins"] == 0
    assert seen["batch_steps"] == 0
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes
