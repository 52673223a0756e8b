"""The decode batch's left padding is paid for in the KV budget (simulator, virtual time only).

A batch of rows with KV lengths ``len_i`` holds ``B * max - sum`` tokens of padding; the engine
reserves ``bytes_per_token`` for each under one ``BATCH_PADDING`` holder per batch before a join
that needs more, gives back the difference when rows leave, and releases it when the batch ends.
"""

from __future__ import annotations

from collections import Counter

from runtime.backends.simulated import SimulatedBatch, greedy_continuation
from runtime.messages import (
    Cancel,
    Failed,
    Finished,
    Holder,
    HolderKind,
    ModelUnloaded,
    Reserve,
    UnloadModel,
)
from runtime.testing.harness import (
    DEFAULT_BUDGET,
    ModelOption,
    engine,
    engine_address_of,
    engines,
    kv_keeper,
    make_sim,
    prefix_cache,
    sim_spec,
)
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

BPT = 1000  # bytes per token of full-attention KV (alloc_step 1: reservations are exact)
PER_TOKEN = 0.001
LONG = tuple(range(100, 160))  # 60 tokens
SHORT = (1, 2, 3, 4, 5)


def checked_sim(budget: int = DEFAULT_BUDGET, **options: ModelOption) -> Simulator:
    """Model "m" loaded (16-token chunks, BPT, PER_TOKEN), the padding checked after every step."""
    timing = {"prefill_s_per_token": PER_TOKEN, "decode_s_per_token": PER_TOKEN}
    model = sim_spec(chunk=16, bytes_per_token=BPT, **timing, **options)
    sim = make_sim(model, budget=budget)
    sim.check_every_step(lambda: assert_padding_is_paid_for(sim))
    return sim


def counters(sim: Simulator) -> Counter[str]:
    return Counter(engine(sim).counters.snapshot())


def padding_holdings(sim: Simulator) -> dict[Holder, int]:
    holdings = kv_keeper(sim).holdings()
    return {h: n for h, n in holdings.items() if h.kind is HolderKind.BATCH_PADDING}


def batch(sim: Simulator) -> SimulatedBatch | None:
    if not engines(sim):
        return None
    handle = engine(sim).decode_batch
    assert handle is None or isinstance(handle, SimulatedBatch)
    return handle


def rows(sim: Simulator) -> int:
    handle = batch(sim)
    return 0 if handle is None else len(handle)


def real_padding(sim: Simulator) -> int:
    handle = batch(sim)
    return 0 if handle is None else handle.padding_tokens


def assert_padding_is_paid_for(sim: Simulator) -> None:
    """After every step: the batch's real padding never exceeds what the keeper granted it."""
    assert sum(padding_holdings(sim).values()) >= BPT * real_padding(sim)
    assert kv_keeper(sim).reserved_bytes <= kv_keeper(sim).budget_bytes


def settle(sim: Simulator) -> None:
    """Deliver what is in flight at this instant (a give-back the engine just sent)."""
    sim.run_until_idle()


def assert_quiescent_and_clean(sim: Simulator) -> None:
    assert padding_holdings(sim) == {}
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes


def test_a_short_sequence_joining_long_ones_reserves_exactly_the_padding() -> None:
    sim = checked_sim()
    sim.send(generate("a", LONG, 40))
    sim.send(generate("b", LONG[::-1], 40))  # same length: a batch of these has no padding
    sim.run_until(lambda: rows(sim) == 2)
    settle(sim)
    assert real_padding(sim) == 0 and padding_holdings(sim) == {}
    assert counters(sim)["batch_padding_asks"] == 0

    sim.send(generate("c", SHORT, 10))
    sim.run_until(lambda: rows(sim) == 3)
    settle(sim)
    # Right-aligned rows: c carries (longest - its length) tokens of padding, nobody else any.
    padding = real_padding(sim)
    assert padding > len(LONG) - len(SHORT)
    [(holder, nbytes)] = padding_holdings(sim).items()
    assert nbytes == BPT * padding
    assert holder == Holder(model="m", epoch=1, kind=HolderKind.BATCH_PADDING, id=holder.id)
    assert engine(sim).statistics().gauges["batch_padding_bytes"] == BPT * padding
    assert counters(sim)["batch_padding_asks"] == counters(sim)["batch_padding_granted"] == 1

    sim.run_until_quiescent()
    for request_id, prompt, n in (("a", LONG, 40), ("b", LONG[::-1], 40), ("c", SHORT, 10)):
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, n)
    assert_quiescent_and_clean(sim)


def test_padding_shrinks_as_rows_leave_and_is_released_when_the_batch_drains() -> None:
    sim = checked_sim()
    sim.send(generate("long", LONG, 40))
    sim.run_until(lambda: len(sim.emitted_tokens("long", 1)) >= 5)
    sim.send(generate("mid", LONG[:30], 12))
    sim.send(generate("short", SHORT, 6))
    sim.run_until(lambda: rows(sim) == 3)
    settle(sim)
    three = real_padding(sim)
    assert sum(padding_holdings(sim).values()) == BPT * three > 0

    sim.run_until(lambda: rows(sim) == 2)  # "short" ended first; its row left
    sim.run_until(lambda: counters(sim)["batch_padding_returned"] == 1)
    settle(sim)
    two = real_padding(sim)
    assert 0 < two < three
    assert sum(padding_holdings(sim).values()) == BPT * two
    assert kv_keeper(sim).statistics().counters["released_partial"] == 1

    sim.run_until(lambda: rows(sim) == 0)  # "mid" ended; "long" went back to the fast path
    settle(sim)
    assert padding_holdings(sim) == {}
    sim.run_until_quiescent()
    assert sim.emitted_tokens("long", 1) == greedy_continuation(LONG, 40)
    assert_quiescent_and_clean(sim)


def test_aborting_the_longest_member_gives_its_padding_back() -> None:
    sim = checked_sim()
    sim.send(generate("long", LONG, 60))
    sim.run_until(lambda: len(sim.emitted_tokens("long", 1)) >= 3)
    sim.send(generate("s1", SHORT, 40))
    sim.send(generate("s2", SHORT[::-1], 40))
    sim.run_until(lambda: rows(sim) == 3)
    settle(sim)
    assert sum(padding_holdings(sim).values()) == BPT * real_padding(sim) > 0

    before = real_padding(sim)
    sim.send(Cancel(request_id="long", incarnation=1))
    sim.run_until(lambda: rows(sim) == 2)
    sim.run_until(lambda: counters(sim)["batch_padding_returned"] == 1)
    settle(sim)
    # The short rows differ by at most a step (they joined one after the other).
    assert real_padding(sim) <= 1 < before
    assert sum(padding_holdings(sim).values()) == BPT * real_padding(sim)

    sim.run_until_quiescent()
    for request_id, prompt in (("s1", SHORT), ("s2", SHORT[::-1])):
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, 40)
    assert_quiescent_and_clean(sim)


def test_under_a_tight_budget_the_newcomer_decodes_alone_and_outputs_stay_exact() -> None:
    # Every sequence's own reservation fits; the short one's padding (about 60 tokens) does not.
    own = (2 * (len(LONG) + 40) + len(SHORT) + 30) * BPT
    sim = checked_sim(budget=own + 20 * BPT)
    sim.send(generate("a", LONG, 40))
    sim.send(generate("b", LONG[::-1], 40))
    sim.run_until(lambda: rows(sim) == 2)
    sim.send(generate("c", SHORT, 30))
    sim.run_until(lambda: counters(sim)["batch_padding_refused"] == 1)
    batch_steps = counters(sim)["batch_steps"]
    sim.run_until(lambda: len(sim.emitted_tokens("c", 1)) >= 10)
    # c decodes on its own steps while the batch goes on stepping; it never joined.
    assert rows(sim) == 2 and counters(sim)["batch_steps"] > batch_steps

    sim.run_until_quiescent()
    for request_id, prompt, n in (("a", LONG, 40), ("b", LONG[::-1], 40), ("c", SHORT, 30)):
        finished = sim.terminal(request_id, 1)
        assert isinstance(finished, Finished)
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, n)
    seen = counters(sim)
    assert seen["batch_padding_granted"] == 0 and seen["batch_joins"] == 2
    # It asked again only after the membership changed (a and b leaving), not at every step.
    assert seen["batch_padding_asks"] == seen["batch_padding_refused"] <= 3
    assert kv_keeper(sim).statistics().counters["refused_no_wait"] == seen["batch_padding_asks"]
    assert_quiescent_and_clean(sim)


def test_a_stale_reply_about_an_earlier_batch_is_released_and_counted() -> None:
    sim = checked_sim()
    sim.send(generate("long", LONG, 20))
    sim.run_until(lambda: len(sim.emitted_tokens("long", 1)) >= 3)
    sim.send(generate("short", SHORT, 5))
    sim.run_until(lambda: rows(sim) == 2)
    [old] = padding_holdings(sim)
    sim.run_until_quiescent()
    assert padding_holdings(sim) == {}
    address = engine_address_of(sim)

    # A grant for that batch's holder arrives after the batch ended (as a late reply would).
    sim.deliver("kv", Reserve(holder=old, nbytes=7 * BPT, timeout_s=0.0), address)
    sim.run_until_idle()
    assert kv_keeper(sim).holding(old) == 0 and old not in kv_keeper(sim).holdings()
    assert counters(sim)["batch_padding_stale"] == 1
    assert sim.dead_letters["stale_padding_reply"] == 1
    # A refusal about it changes nothing either.
    sim.deliver("kv", Reserve(holder=old, nbytes=1 << 40, timeout_s=0.0), address)
    sim.run_until_idle()
    assert counters(sim)["batch_padding_stale"] == 2
    assert_quiescent_and_clean(sim)


def test_a_failed_batch_step_releases_the_padding() -> None:
    # The 8th sample call falls inside a batch step of these two (see test_batching's fixture).
    sim = checked_sim(fail_sample_call=8)
    sim.send(generate("long", LONG, 10))
    sim.run_until(lambda: len(sim.emitted_tokens("long", 1)) >= 1)
    sim.send(generate("short", SHORT, 10))
    sim.run_until_quiescent()
    for request_id in ("long", "short"):
        failed = sim.terminal(request_id, 1)
        assert isinstance(failed, Failed) and "batched decode step failed" in failed.message
    assert counters(sim)["batch_padding_granted"] == 1
    assert kv_keeper(sim).reserved_bytes == 0
    assert_quiescent_and_clean(sim)


def test_unloading_while_batched_frees_the_padding_with_everything_else() -> None:
    sim = checked_sim()
    sim.send(generate("long", LONG, 40))
    sim.run_until(lambda: len(sim.emitted_tokens("long", 1)) >= 3)
    sim.send(generate("short", SHORT, 40))
    sim.run_until(lambda: rows(sim) == 2)
    settle(sim)
    assert padding_holdings(sim) != {}

    assert sim.ask(UnloadModel(model="m")) == ModelUnloaded(model="m", epoch=1)
    assert kv_keeper(sim).holdings() == {} and kv_keeper(sim).reserved_bytes == 0
