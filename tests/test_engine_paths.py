"""Engine paths on the deterministic simulator that no other test drives directly.

Checkpoint snapshots of a non-trimmable cache (taken, reserved with their sequence, dropped when
its reservation has no room for them), the
cold fallback after a lookup hit that cannot be restored, and exactly-one-terminal races (an abort
against the last decode step, a cancel or an unload while the KV reservation waits in the queue, a
backend fault in sampling). Virtual time only: nothing sleeps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from actors.engine.checkpoints import BRANCH_REACH, CheckpointRule, plan_checkpoints
from actors.kv_budget import QueuedReservation
from runtime.backends.simulated import SimulatedBackend, greedy_continuation
from runtime.kernel.core import Address
from runtime.messages import (
    Abort,
    Cancel,
    Cancelled,
    ComputeDone,
    Failed,
    Finished,
    FinishReason,
    Holder,
    HolderKind,
    Lookup,
    LookupResult,
    Message,
    ModelSpec,
    ModelUnloaded,
    Rejected,
    Reserve,
    ReusePath,
    Started,
    TokensEmitted,
    UnloadModel,
    Usage,
)
from runtime.testing.harness import (
    DEFAULT_BUDGET,
    ModelOption,
    engine,
    engine_address_of,
    kv_keeper,
    make_sim,
    prefix_cache,
    router,
    sim_spec,
)
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

BPT = 1024  # bytes_per_token of every model here (alloc_step 1)
FIXED = 512  # a non-trimmable model's untrimmable state: what each of its snapshots holds
EVERY = 8
CHUNK = 4
PROMPT = tuple(range(100, 130))  # 30 tokens, none whitespace: no word-boundary snapshot
MAX_TOKENS = 6
# The snapshot plan of a cold prefill of PROMPT: every 8 tokens, then its end.
PLANNED = [8, 16, 24, 30]
# What the sequence itself leaves behind: the prompt and every generated token but the last,
# which was sampled and emitted but never fed to the model.
END_STATE = len(PROMPT) + MAX_TOKENS - 1


# --------------------------------------------------------------------------- helpers


def spec(chunk: int = CHUNK, **options: ModelOption) -> ModelSpec:
    """Model "m" with BPT bytes per token."""
    return sim_spec(chunk=chunk, bytes_per_token=BPT, **options)


def checkpoint_sim(budget: int = DEFAULT_BUDGET) -> Simulator:
    model = spec(trimmable=False, checkpoint_every_tokens=EVERY, fixed_state_bytes=FIXED)
    return make_sim(model, budget=budget)


def emitted(sim: Simulator, request_id: str, incarnation: int = 1) -> list[int]:
    return sim.emitted_tokens(request_id, incarnation)


def terminals(sim: Simulator, request_id: str, incarnation: int = 1) -> list[Message]:
    ends = (Finished, Cancelled, Failed, Rejected)
    return [e for e in sim.events(request_id, incarnation) if isinstance(e, ends)]


def started(sim: Simulator, request_id: str, incarnation: int = 1) -> list[Started]:
    return [e for e in sim.events(request_id, incarnation) if isinstance(e, Started)]


def engine_counters(sim: Simulator) -> Counter[str]:
    """The engine's counters; one never incremented reads 0."""
    return Counter(engine(sim).counters.snapshot())


def engine_gauges(sim: Simulator) -> dict[str, int]:
    return dict(engine(sim).statistics().gauges)


def sequence_holder(sequence_id: int) -> Holder:
    return Holder(model="m", epoch=1, kind=HolderKind.SEQUENCE, id=sequence_id)


def intercept(sim: Simulator, hook: Callable[[Address, Message, Address], bool]) -> None:
    """Route every delivery through ``hook``; it returns True when it delivered the message itself.

    Actors' sends go through ``sim.deliver`` (looked up on the instance), so this sees them all.
    """
    real = sim.deliver

    def deliver(to: Address, message: Message, sender: Address) -> None:
        if not hook(to, message, sender):
            real(to, message, sender)

    sim.deliver = deliver  # type: ignore[method-assign]


# --------------------------------------------------------------------------- 1. snapshots


def test_the_snapshot_plan_of_the_prompt_is_the_one_these_tests_expect() -> None:
    def decode(ids: Sequence[int]) -> str:  # as the simulated backend decodes
        return bytes(ids).decode("utf-8", errors="replace")

    rule = CheckpointRule(spacing=EVERY, most=len(PLANNED))
    assert plan_checkpoints(PROMPT, 0, len(PROMPT), decode, rule) == PLANNED


def test_checkpoints_of_a_non_trimmable_prefill_become_points_of_its_final_entry() -> None:
    sim = checkpoint_sim()
    sim.send(generate("a", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()

    out = greedy_continuation(PROMPT, MAX_TOKENS)
    assert terminals(sim, "a") == [
        Finished(
            request_id="a",
            incarnation=1,
            reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=30, cached_prompt_tokens=0, completion_tokens=MAX_TOKENS),
        )
    ]
    assert emitted(sim, "a") == out
    # One entry: the final state, restorable whole and at every snapshot. Each snapshot holds only
    # the untrimmable state (FIXED bytes); the per-token KV is stored once, in the final state.
    [entry] = prefix_cache(sim).entries()
    assert entry.tokens == (PROMPT + tuple(out))[:END_STATE]
    assert entry.points == tuple(PLANNED)
    total = END_STATE * BPT + FIXED + len(PLANNED) * FIXED
    assert entry.nbytes == total
    assert entry.entry_id == 1  # the snapshots' bytes came with the sequence's reservation
    assert not (entry.trimmable or entry.leases or entry.doomed)
    # The entry's bytes are reserved in the keeper under its own holder, and nothing else is.
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes == total
    holder = Holder(model="m", epoch=1, kind=HolderKind.PREFIX_ENTRY, id=entry.entry_id)
    assert kv_keeper(sim).holdings() == {holder: total}
    assert kv_keeper(sim).queued() == ()
    counters = engine_counters(sim)
    assert counters["snapshots_taken"] == len(PLANNED)
    assert counters["snapshots_refused"] == 0
    assert counters["prefilled_tokens"] == len(PROMPT)  # chunks land on checkpoints, never redo
    gauges = engine_gauges(sim)
    assert (gauges["sequences"], gauges["entries"], gauges["entry_bytes"]) == (0, 1, total)
    assert (gauges["entry_points"], gauges["pending_snapshots"]) == (len(PLANNED), 0)


@pytest.mark.parametrize(
    ("prompt", "path", "cached"),
    [
        # Shares 20 tokens: the deepest point at or below 20 is 16.
        pytest.param((*PROMPT[:20], *range(200, 210)), ReusePath.CHECKPOINT, 16, id="point-16"),
        # The same prompt again: at most its length - 1 is reused, so the deepest point below
        # the end (a prompt of words or lines has one a few tokens back; this one has none).
        pytest.param(PROMPT, ReusePath.CHECKPOINT, 24, id="repeat"),
        # The next turn: the whole final state.
        pytest.param(None, ReusePath.CHECKPOINT, END_STATE, id="next-turn"),
    ],
)
def test_a_later_prompt_restores_at_a_point_of_the_final_entry(
    prompt: tuple[int, ...] | None, path: ReusePath, cached: int
) -> None:
    sim = checkpoint_sim()
    sim.send(generate("a", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()
    if prompt is None:
        prompt = (*PROMPT, *emitted(sim, "a"), *range(200, 204))
    before = engine_counters(sim)

    sim.send(generate("b", prompt, MAX_TOKENS))
    sim.run_until_quiescent()

    [start] = started(sim, "b")
    assert (start.path, start.cached_tokens) == (path, cached)
    # The simulated backend checks each snapshot against the state it is restored with.
    assert emitted(sim, "b") == greedy_continuation(prompt, MAX_TOKENS)
    after = engine_counters(sim)
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(prompt) - cached
    assert after["fallback_trim_refused"] == 0
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes


@pytest.mark.parametrize(("reach_back", "cached"), [(16, 20), (8, 16)], ids=["reached", "too-far"])
def test_a_branch_past_a_checkpoint_cuts_back_to_the_common_prefix_where_the_state_reaches(
    reach_back: int, cached: int
) -> None:
    """A prompt sharing 20 tokens of a 35-token non-trimmable entry: its nearest point is 16, but
    a backend whose state still holds what a cut to 20 needs (llama.cpp's sliding rings keep cells
    past their window: ``reach_back_tokens`` here) cuts back there, a trim that reuses 4 tokens
    more; 15 tokens back is more than 8 reach, so the point stands."""
    model = spec(
        trimmable=False,
        checkpoint_every_tokens=EVERY,
        fixed_state_bytes=FIXED,
        reach_back_tokens=reach_back,
    )
    sim = make_sim(model)
    sim.send(generate("a", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()
    prompt = (*PROMPT[:20], *range(200, 210))
    before = engine_counters(sim)

    sim.send(generate("b", prompt, MAX_TOKENS))
    sim.run_until_quiescent()

    [start] = started(sim, "b")
    reached = cached == 20
    path = ReusePath.TRIM if reached else ReusePath.CHECKPOINT
    assert (start.path, start.cached_tokens) == (path, cached)
    assert emitted(sim, "b") == greedy_continuation(prompt, MAX_TOKENS)
    after = engine_counters(sim)
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(prompt) - cached
    assert after["reached_past_checkpoint"] == int(reached)
    assert after["reached_tokens"] == (4 if reached else 0)
    [ended] = terminals(sim, "b")
    assert isinstance(ended, Finished) and ended.usage.cached_prompt_tokens == cached
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes


class _StopAfter:
    """A prefill's stop flag that trips after ``checks`` looks, setting the sequence's own flag
    then, as an abort landing while the chunk runs would."""

    def __init__(self, checks: int, flag: Any) -> None:
        self._left, self._flag = checks, flag

    def is_set(self) -> bool:
        self._left -= 1
        if self._left < 0:
            self._flag.set()
        return bool(self._flag.is_set())


@pytest.mark.parametrize(("keeps", "cached"), [(True, 16), (False, 0)], ids=["keeps", "undoes"])
def test_a_prefill_stopped_past_a_checkpoint_leaves_an_entry_where_the_backend_kept_it(
    monkeypatch: pytest.MonkeyPatch, keeps: bool, cached: int
) -> None:
    """Stopped after 20 of the prompt's 30 tokens, in one chunk with points at 8, 16, 24 and
    30: a backend that goes back to its last snapshot (llama.cpp's sliding-window models:
    ``PrefillInterrupted.kept``) leaves the state at 16, kept as an entry with both snapshots,
    which the same prompt then restores; one that undoes the call leaves nothing."""
    model = spec(
        chunk=32,
        trimmable=False,
        checkpoint_every_tokens=EVERY,
        fixed_state_bytes=FIXED,
        interrupt_keeps_snapshots=keeps,
    )
    real = SimulatedBackend.prefill
    stopped: list[bool] = []

    def stop_once(self: SimulatedBackend, state: Any, token_ids: Any, **kw: Any) -> Any:
        if kw.get("stop") is not None and not stopped:
            stopped.append(True)
            kw["stop"] = _StopAfter(20, kw["stop"])
        return real(self, state, token_ids, **kw)

    monkeypatch.setattr(SimulatedBackend, "prefill", stop_once)
    sim = make_sim(model)
    sim.send(generate("a", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()

    [ended] = terminals(sim, "a")
    assert isinstance(ended, Cancelled) and emitted(sim, "a") == []
    assert engine_counters(sim)["prefilled_tokens"] == cached
    assert [len(e.tokens) for e in prefix_cache(sim).entries()] == ([cached] if cached else [])
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes

    sim.send(generate("b", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()
    [start] = started(sim, "b")
    assert start.cached_tokens == cached
    assert emitted(sim, "b") == greedy_continuation(PROMPT, MAX_TOKENS)
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes


def test_a_chunk_with_a_checkpoint_inside_ends_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk that would run past a checkpoint ends there, so the piece after the cut goes into
    the next chunk's first pass, not a short pass of its own (a pass reads every weight)."""
    passes: list[tuple[int, int]] = []
    real = SimulatedBackend.prefill

    def record(self: SimulatedBackend, state: Any, token_ids: Any, **kw: Any) -> Any:
        at = state.length
        for point in [*kw.get("snapshot_at", ()), at + len(token_ids)]:
            if point > at:  # the backend cuts its passes at each point
                passes.append((at, point))
                at = point
        return real(self, state, token_ids, **kw)

    monkeypatch.setattr(SimulatedBackend, "prefill", record)
    sim = make_sim(
        spec(chunk=64, trimmable=False, fixed_state_bytes=FIXED, checkpoint_every_tokens=0)
    )
    prompt = [97 + i % 26 for i in range(150)]
    prompt[99] = 10  # a newline: the last line starts at 100
    sim.send(generate("a", tuple(prompt), 2))
    sim.run_until_quiescent()

    assert emitted(sim, "a") == greedy_continuation(tuple(prompt), 2)
    [entry] = prefix_cache(sim).entries()
    assert entry.points == (100, 150)
    # Not (64, 100), (100, 128), (128, 150): the chunk after 64 ended at the line start.
    assert passes[:3] == [(0, 64), (64, 100), (100, 150)]


def test_a_cheap_snapshot_checkpoints_a_long_prompt_every_64_tokens_by_default() -> None:
    """No option: a snapshot (FIXED bytes) costs less than the KV of one token (BPT bytes), so the
    spacing is the floor, MIN_SPACING (64), not checkpoint_every_tokens (512)."""
    sim = make_sim(spec(chunk=64, trimmable=False, fixed_state_bytes=FIXED))
    prompt = tuple(97 + i % 26 for i in range(1030))  # letters only: no word or line boundary
    sim.send(generate("a", prompt, 2))
    sim.run_until_quiescent()

    assert emitted(sim, "a") == greedy_continuation(prompt, 2)
    [entry] = prefix_cache(sim).entries()
    branch = 1030 - BRANCH_REACH  # the point an edit near the end falls back to
    # 512 and 1024 lie within 64 / PERIODIC_GAP_SHARE tokens of 518 and 1030: left out, as each
    # would end a pass of 6 tokens.
    periodic = set(range(64, 1030, 64)) - {512, 1024}
    expected = tuple(sorted({*periodic, branch, 1030}))
    assert (len(entry.tokens), entry.points) == (1031, expected)
    total = 1031 * BPT + FIXED + 16 * FIXED
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes == total
    assert engine_counters(sim)["snapshots_taken"] == 16


@pytest.mark.parametrize(
    ("spare_snapshots", "kept"),
    [
        pytest.param(0, (), id="no-room-for-any"),
        pytest.param(1, (30,), id="room-for-the-end-of-the-prompt"),
        # One periodic point: the spacing doubles until one multiple is left below the target.
        pytest.param(2, (16, 30), id="room-for-one-periodic-too"),
    ],
)
def test_a_budget_with_little_room_checkpoints_less_but_still_runs_the_request(
    spare_snapshots: int, kept: tuple[int, ...]
) -> None:
    # The sequence's KV (prompt + max_tokens, and the fixed state) fits with this much to spare.
    budget = (len(PROMPT) + MAX_TOKENS) * BPT + FIXED + spare_snapshots * FIXED
    sim = checkpoint_sim(budget)
    sim.send(generate("a", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()

    terminal = sim.terminal("a", 1)
    assert isinstance(terminal, Finished) and terminal.reason is FinishReason.LENGTH
    assert emitted(sim, "a") == greedy_continuation(PROMPT, MAX_TOKENS)
    counters = engine_counters(sim)
    # Only the points the room affords are planned, the end of the prompt first.
    assert (counters["snapshots_taken"], counters["snapshots_refused"]) == (len(kept), 0)
    [entry] = prefix_cache(sim).entries()
    assert entry.points == kept
    total = END_STATE * BPT + FIXED + len(kept) * FIXED
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes == total
    assert kv_keeper(sim).statistics().counters["queued"] == 0
    gauges = engine_gauges(sim)
    assert (gauges["entries"], gauges["entry_points"], gauges["pending_snapshots"]) == (
        1,
        len(kept),
        0,
    )


def test_snapshot_bytes_are_reserved_with_the_sequence_and_evict_like_any_other() -> None:
    """A prompt's reservation holds its KV and room for its planned snapshots, so a full prefix
    cache gives way to the snapshots as it does to the KV (no snapshot asks on its own)."""
    first = tuple(range(200, 230))
    need = END_STATE * BPT + FIXED + len(PLANNED) * FIXED  # one prompt's entry, points included
    # Room for one entry only, and 1/32 of it still affords the 4 snapshots of a prompt.
    budget = 70_000
    assert need < budget < 2 * need and budget // 32 // FIXED == len(PLANNED)
    sim = checkpoint_sim(budget)
    asked: list[tuple[HolderKind, int]] = []

    def record(to: Address, message: Message, sender: Address) -> bool:
        if to == "kv" and isinstance(message, Reserve):
            asked.append((message.holder.kind, message.nbytes))
        return False

    intercept(sim, record)
    sim.send(generate("a", first, MAX_TOKENS))
    sim.run_until_quiescent()
    [old] = prefix_cache(sim).entries()
    assert old.points == tuple(PLANNED)
    sim.send(generate("b", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()

    reserved = (len(PROMPT) + MAX_TOKENS) * BPT + FIXED + len(PLANNED) * FIXED
    assert asked == [(HolderKind.SEQUENCE, reserved)] * 2
    assert emitted(sim, "b") == greedy_continuation(PROMPT, MAX_TOKENS)
    [entry] = prefix_cache(sim).entries()
    assert (entry.tokens[: len(PROMPT)], entry.points) == (PROMPT, tuple(PLANNED))
    assert prefix_cache(sim).statistics().counters["evictions"] == 1  # the first prompt's
    counters = engine_counters(sim)
    assert (counters["snapshots_taken"], counters["snapshots_refused"]) == (2 * len(PLANNED), 0)
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes == need


# --------------------------------------------------------------------------- 3. fallback


@pytest.mark.parametrize(
    ("counter", "entry_tokens"),
    [
        # The real non-trimmable entry, which the result asks to trim to 20 (not one of its points).
        pytest.param("fallback_trim_refused", END_STATE, id="trim-refused"),
        # An entry id the engine does not hold.
        pytest.param("fallback_entry_missing", None, id="entry-missing"),
    ],
)
def test_a_hit_that_cannot_be_restored_starts_cold(counter: str, entry_tokens: int | None) -> None:
    sim = checkpoint_sim()
    sim.send(generate("warm", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()
    by_length = {len(e.tokens): e.entry_id for e in prefix_cache(sim).entries()}
    entry_id = 999 if entry_tokens is None else by_length[entry_tokens]
    assert entry_id == (999 if entry_tokens is None else 1)

    # The prompt shares 20 tokens with PROMPT (so also the 8- and 16-token points).
    prompt = (*PROMPT[:20], *range(200, 210))
    crafted: list[LookupResult] = []
    address = engine_address_of(sim)

    def answer_first(to: Address, message: Message, sender: Address) -> bool:
        # Answer the engine's Lookup before the prefix manager does; its real answer, which
        # arrives second, is then stale (and its lease must be given back).
        if to == "prefix" and isinstance(message, Lookup) and not crafted:
            result = LookupResult(
                sequence_id=message.sequence_id,
                epoch=1,
                entry_id=entry_id,
                matched=20,
                path=ReusePath.TRIM,
                lease_id=None,
                generation=0,
            )
            crafted.append(result)
            sim.deliver(address, result, "prefix")
        return False

    intercept(sim, answer_first)
    before = engine_counters(sim)
    sim.send(generate("b", prompt, MAX_TOKENS))
    sim.run_until_quiescent()

    assert len(crafted) == 1
    assert started(sim, "b") == [
        Started(
            request_id="b",
            incarnation=1,
            sequence_id=2,
            epoch=1,
            prompt_tokens=30,
            cached_tokens=0,
            path=ReusePath.MISS,
        )
    ]
    assert terminals(sim, "b") == [
        Finished(
            request_id="b",
            incarnation=1,
            reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=30, cached_prompt_tokens=0, completion_tokens=MAX_TOKENS),
        )
    ]
    assert emitted(sim, "b") == greedy_continuation(prompt, MAX_TOKENS)
    after = engine_counters(sim)
    assert after[counter] - before[counter] == 1
    assert after["path_miss"] - before["path_miss"] == 1
    assert after["path_checkpoint"] == after["path_trim"] == 0
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == 30  # all of it, cold
    # The real (checkpoint) hit came second: its lease was released, nothing stays leased.
    assert sim.dead_letters["stale_lookup_result"] == 1
    assert prefix_cache(sim).statistics().counters["hits_checkpoint"] == 1
    assert prefix_cache(sim).leased_entry_ids() == frozenset()
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes


def test_a_refused_trim_does_not_make_the_cached_prompt_tokens_counter_negative() -> None:
    sim = checkpoint_sim()
    sim.send(generate("warm", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()
    [entry] = prefix_cache(sim).entries()
    entry_id = entry.entry_id
    address = engine_address_of(sim)

    def answer_first(to: Address, message: Message, sender: Address) -> bool:
        if to == "prefix" and isinstance(message, Lookup):
            result = LookupResult(
                sequence_id=message.sequence_id,
                epoch=1,
                entry_id=entry_id,
                matched=20,
                path=ReusePath.TRIM,
                lease_id=None,
                generation=0,
            )
            sim.deliver(address, result, "prefix")
            return True  # the prefix manager never sees this Lookup
        return False

    intercept(sim, answer_first)
    sim.send(generate("b", (*PROMPT[:20], *range(200, 210)), MAX_TOKENS))
    sim.run_until_quiescent()
    counters = engine_counters(sim)
    assert counters["fallback_trim_refused"] == 1
    # Nothing was served from cache by either request; the counter says -20.
    assert counters["cached_prompt_tokens"] == 0


# --------------------------------------------------------------------------- 4. one terminal

DECODE_S = 1.0


def timed_sim(budget: int = DEFAULT_BUDGET, seed: int = 0, **options: int) -> Simulator:
    """Prefill is free and each decode step takes DECODE_S, so steps end on whole seconds."""
    model = spec(chunk=16, decode_s_per_token=DECODE_S, **options)
    return make_sim(model, budget=budget, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("abort_first", [True, False], ids=["abort-first", "done-first"])
def test_an_abort_racing_the_last_decode_step_gives_one_terminal(
    abort_first: bool, seed: int
) -> None:
    n = 4
    prompt = (1, 2, 3, 4, 5)
    sim = timed_sim(seed=seed)
    address = engine_address_of(sim)
    raced: list[Message] = []

    def race(to: Address, message: Message, sender: Address) -> bool:
        # The ComputeDone that arrives once n - 1 tokens are out is the last step's: put the
        # router's Abort into the engine's mailbox just before it, or just after it.
        if to != address or not isinstance(message, ComputeDone) or raced:
            return False
        if len(emitted(sim, "a")) != n - 1:
            return False
        abort = Abort(sequence_id=1, epoch=1)
        order = [(abort, "router"), (message, sender)]
        for m, s in order if abort_first else reversed(order):
            raced.append(m)
            sim.deliver(to, m, s)
        return True

    intercept(sim, race)
    sim.send(generate("a", prompt, n))
    sim.run_until_quiescent()

    assert len(raced) == 2
    out = greedy_continuation(prompt, n)
    ends = terminals(sim, "a")
    assert len(ends) == 1
    counters = engine_counters(sim)
    if abort_first:
        # The step's token was computed, but the abort wins: it is neither emitted nor counted.
        assert ends[0] == Cancelled(
            request_id="a",
            incarnation=1,
            usage=Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=n - 1),
            reason="cancelled",
        )
        assert emitted(sim, "a") == out[: n - 1]
        assert counters["cancelled"] == 1
        assert counters["aborts_noop"] == 0
    else:
        assert ends[0] == Finished(
            request_id="a",
            incarnation=1,
            reason=FinishReason.LENGTH,
            usage=Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=n),
        )
        assert emitted(sim, "a") == out
        assert counters["aborts_noop"] == 1
        assert counters["cancelled"] == 0
    # Either way the cached state holds the prompt and n - 1 tokens (the last step fed the
    # pending token n - 1 and sampled token n, which is never fed).
    kept = len(prompt) + n - 1
    assert [len(e.tokens) for e in prefix_cache(sim).entries()] == [kept]
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes == kept * BPT
    assert router(sim).live_sequences() == {}


def test_a_cancel_while_the_reservation_waits_drops_it_from_the_keeper() -> None:
    # A reserves 15 tokens of a 20-token budget; B needs 15 too and waits in the keeper's queue.
    sim = timed_sim(budget=20 * BPT)
    sim.send(generate("a", (1, 2, 3, 4, 5), 10))
    sim.run_until_idle()
    sim.send(generate("b", (6, 7, 8, 9, 10), 10))
    sim.run_until_idle()
    assert kv_keeper(sim).queued() == (QueuedReservation(sequence_holder(2), 15 * BPT, 30.0),)
    sim.advance(1.5)  # A is decoding; B still waits
    assert kv_keeper(sim).queued() == (QueuedReservation(sequence_holder(2), 15 * BPT, 30.0),)

    sim.send(Cancel(request_id="b", incarnation=1))
    sim.run_until_idle()
    assert kv_keeper(sim).queued() == ()
    assert terminals(sim, "b") == [
        Cancelled(
            request_id="b",
            incarnation=1,
            usage=Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=0),
            reason="cancelled",
        )
    ]
    sim.run_until_quiescent()

    assert sim.events("b", 1) == terminals(sim, "b")  # no Started, no tokens: just the end
    a_end = sim.terminal("a", 1)
    assert isinstance(a_end, Finished) and a_end.usage.completion_tokens == 10
    assert len(terminals(sim, "a")) == 1
    kv_counters = kv_keeper(sim).statistics().counters
    assert kv_counters["queued"] == 1
    assert kv_counters["dropped_waiting"] == 1
    assert kv_counters["granted"] == 1  # A only: B was never granted, not even after A ended
    assert kv_counters["stale_timer"] == 1  # B's deadline fired for a ticket already dropped
    assert kv_counters["refused_timeout"] == 0
    assert sim.dead_letters["stale_reservation_reply"] == 0
    assert kv_keeper(sim).holding(sequence_holder(2)) == 0
    assert (
        prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes == 14 * BPT
    )  # A's end state only


@pytest.mark.parametrize("failing_call", [1, 3])
def test_a_backend_fault_in_sampling_fails_once_with_the_tokens_made_before_it(
    failing_call: int,
) -> None:
    prompt = (1, 2, 3, 4, 5)
    sim = timed_sim(fail_sample_call=failing_call)
    sim.send(generate("a", prompt, 6))
    sim.run_until_quiescent()

    made = failing_call - 1  # one sample call per decode step
    ends = terminals(sim, "a")
    assert len(ends) == 1
    failed = ends[0]
    assert isinstance(failed, Failed)
    assert (failed.code, failed.retryable) == ("backend_error", True)
    assert f"injected fault in sample call {failing_call}" in failed.message
    assert failed.usage == Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=made)
    assert emitted(sim, "a") == greedy_continuation(prompt, 6)[:made]
    assert [type(e) for e in sim.events("a", 1)] == [Started, *[TokensEmitted] * made, Failed]
    assert engine_counters(sim)["failed_backend_error"] == 1
    # A state that saw an error is never cached; everything it held is released.
    assert prefix_cache(sim).entries() == ()
    assert kv_keeper(sim).reserved_bytes == 0
    assert kv_keeper(sim).holdings() == {}


# --------------------------------------------------------------------------- 5. unload


def test_unload_cancels_a_request_queued_for_kv_and_frees_everything() -> None:
    sim = timed_sim(budget=20 * BPT)
    address = engine_address_of(sim)
    sim.send(generate("a", (1, 2, 3, 4, 5), 10))
    sim.run_until_idle()
    sim.send(generate("b", (6, 7, 8, 9, 10), 10))
    sim.advance(2.5)  # A's steps ended at t=0, 1 and 2 (three tokens); the fourth is in flight
    assert len(emitted(sim, "a")) == 3
    assert kv_keeper(sim).queued() == (QueuedReservation(sequence_holder(2), 15 * BPT, 30.0),)

    reply = sim.ask(UnloadModel(model="m"))
    assert reply == ModelUnloaded(model="m", epoch=1)
    assert terminals(sim, "b") == [
        Cancelled(
            request_id="b",
            incarnation=1,
            usage=Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=0),
            reason="model_unloaded",
        )
    ]
    assert terminals(sim, "a") == [
        Cancelled(
            request_id="a",
            incarnation=1,
            usage=Usage(prompt_tokens=5, cached_prompt_tokens=0, completion_tokens=3),
            reason="model_unloaded",
        )
    ]
    # Both terminals were out, and the memory free, by the time the unload was answered.
    assert kv_keeper(sim).reserved_bytes == 0
    assert kv_keeper(sim).queued() == ()
    assert kv_keeper(sim).holdings() == {}
    assert prefix_cache(sim).total_bytes == 0
    assert address not in sim.addresses()
    sim.run_until_quiescent()
    assert len(terminals(sim, "a")) == len(terminals(sim, "b")) == 1
    assert kv_keeper(sim).statistics().counters["granted"] == 1  # B was never granted
    assert kv_keeper(sim).reserved_bytes == 0
    assert router(sim).counters["orphaned_requests"] == 0
