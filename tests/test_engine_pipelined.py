"""Pipelined decoding on the simulator (``pipelined=True``: steps are built on a token before it is
read, and a lone stream keeps one step queued, as on MLX) and queued steps alone (``queue_steps``:
the queued step feeds the token the one before it read, as on llama.cpp) against step-by-step
decoding.

The output never changes: tokens, text, logprobs, seeded draws and endings are the same. What may
change is what the cache holds when a sequence ends: a token fed and never shown (an EOS, one read
after a cancel, one computed by the step queued behind the end). The entry it leaves is keyed by
exactly those tokens, and a later prompt reuses it only where they match. Virtual time only.
"""

from __future__ import annotations

import pytest

from runtime.backends.simulated import EOS_TOKEN_ID, SimulatedState, greedy_continuation
from runtime.messages import (
    Cancel,
    Cancelled,
    Failed,
    Finished,
    FinishReason,
    Message,
    Sampling,
    Started,
    TokensEmitted,
)
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

PROMPT = tuple(b"the quick brown fox")
DECODE_S = 1.0


def sim(pipelined: bool, **options: ModelOption) -> Simulator:
    """Prefill is free, each decode step takes a second."""
    return make_sim(sim_spec(decode_s_per_token=DECODE_S, pipelined=pipelined, **options))


def events(s: Simulator, request_id: str) -> list[Message]:
    """The request's events without the Started (its timing fields are not compared)."""
    return [
        e
        for e in s.events(request_id, 1)
        if isinstance(e, (TokensEmitted, Finished, Cancelled, Failed))
    ]


def entries_match_their_states(s: Simulator) -> list[tuple[int, ...]]:
    """Every entry's key equals the tokens its state holds; returns the keys."""
    keys = []
    for entry in prefix_cache(s).entries():
        state = engine(s).entry_state(entry.entry_id)
        assert isinstance(state, SimulatedState)
        assert tuple(state.tokens) == entry.tokens
        keys.append(entry.tokens)
    return keys


SAMPLINGS = {
    "greedy": Sampling(),
    "seeded": Sampling(temperature=1.0, top_p=0.9, seed=7),
    "penalties": Sampling(temperature=0.8, seed=3, repetition_penalty=1.3, presence_penalty=0.4),
    "dry": Sampling(temperature=0.7, seed=5, dry_multiplier=0.8),  # reads every token first
    "logprobs": Sampling(logprobs=True, top_logprobs=3),
}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize(
    ("n", "eos_every", "stop"),
    [(12, 0, ()), (40, 7, ()), (40, 0, ("o",)), (1, 0, ())],
    ids=["length", "eos", "stop-string", "one-token"],
)
def test_pipelined_output_equals_step_by_step(
    sampling: Sampling, n: int, eos_every: int, stop: tuple[str, ...]
) -> None:
    outputs = []
    for pipelined, queued in ((False, False), (True, True), (False, True)):
        s = sim(pipelined, eos_every=eos_every, queue_steps=queued)
        s.send(generate("a", PROMPT, n, sampling=sampling, stop=stop))
        s.run_until_quiescent()
        outputs.append(events(s, "a"))
        entries_match_their_states(s)
        assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("queued", [False, True], ids=["step-by-step", "queued"])
def test_a_queued_step_feeds_the_token_read_before_the_loop_sees_it(queued: bool) -> None:
    """Not pipelined: step-by-step, the step that read the token a stop string ends on was the
    last, so the cache lacks that token; a step queued behind it has fed it already."""
    s = sim(False, queue_steps=queued)
    s.send(generate("a", PROMPT, 40, stop=("o",)))
    s.run_until_quiescent()
    end = s.terminal("a", 1)
    assert isinstance(end, Finished) and end.stop == "o"
    shown = s.emitted_tokens("a", 1)
    [key] = entries_match_their_states(s)
    assert key == (*PROMPT, *shown[: len(shown) - (0 if queued else 1)])
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


@pytest.mark.parametrize("trimmable", [True, False], ids=["trimmable", "not-trimmable"])
def test_an_eos_is_fed_ahead_only_where_it_can_be_cut_back(trimmable: bool) -> None:
    s = sim(True, eos_every=7, trimmable=trimmable)
    s.send(generate("a", PROMPT, 40))
    s.run_until_quiescent()
    shown = s.emitted_tokens("a", 1)
    assert shown == greedy_continuation(PROMPT, 40, eos_every=7)
    end = s.terminal("a", 1)
    assert isinstance(end, Finished) and end.reason is FinishReason.STOP
    # A step was built on the EOS before it was read only on a cache that trims it back out.
    eos = (EOS_TOKEN_ID,) if trimmable else ()
    assert entries_match_their_states(s) == [(*PROMPT, *shown, *eos)]
    # The next turn, the reply without the EOS, reuses all of it either way.
    follow = (*PROMPT, *shown, *b" more")
    s.send(generate("b", follow, 4))
    s.run_until_quiescent()
    started = next(e for e in s.events("b", 1) if isinstance(e, Started))
    assert started.cached_tokens == len(PROMPT) + len(shown)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "queued"])
def test_a_cancel_lands_before_the_next_token_and_the_entry_holds_what_was_fed(
    pipelined: bool,
) -> None:
    s = sim(pipelined, queue_steps=True)
    s.send(generate("a", PROMPT, 40))
    s.run_until(lambda: len(s.emitted_tokens("a", 1)) >= 5)
    s.advance(DECODE_S / 2)  # the next token is computing, one more is queued
    s.send(Cancel(request_id="a", incarnation=1))
    s.run_until_quiescent()
    shown = s.emitted_tokens("a", 1)
    end = s.terminal("a", 1)
    assert isinstance(end, Cancelled)
    assert end.usage.completion_tokens == len(shown)
    assert shown == greedy_continuation(PROMPT, 40)[: len(shown)]
    [key] = entries_match_their_states(s)
    assert key[: len(PROMPT) + len(shown)] == (*PROMPT, *shown)
    assert len(key) - len(PROMPT) - len(shown) <= 2  # at most the token read and one queued
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "queued"])
def test_a_stop_string_end_waits_for_the_queued_step_and_gives_everything_back_first(
    pipelined: bool,
) -> None:
    s = sim(pipelined, queue_steps=True)
    s.send(generate("a", PROMPT, 40, stop=("o",)))
    s.run_until(lambda: s.terminal("a", 1) is not None)
    end = s.terminal("a", 1)
    assert isinstance(end, Finished) and end.stop == "o"
    s.run_until_idle()  # no time passes: what the engine sent before the terminal is handled
    # The queued step came back before the terminal went out: the state is an entry already.
    [key] = entries_match_their_states(s)
    shown = s.emitted_tokens("a", 1)
    assert key[: len(PROMPT) + len(shown)] == (*PROMPT, *shown)
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


def test_a_failure_building_the_next_step_comes_after_the_token_it_was_built_on() -> None:
    ends = []
    for pipelined in (False, True):
        # Call 1 prefills the prompt; the third feeds the second token to the model.
        s = sim(pipelined, fail_prefill_call=3)
        s.send(generate("a", PROMPT, 10))
        s.run_until_quiescent()
        ends.append(events(s, "a"))
        assert prefix_cache(s).entries() == ()  # a state that saw an error is never cached
        assert kv_keeper(s).reserved_bytes == 0
    assert ends[0] == ends[1]
    assert [type(e) for e in ends[1]] == [TokensEmitted, TokensEmitted, Failed]


def test_a_later_prompt_reuses_a_pipelined_entry_only_where_its_tokens_match() -> None:
    s = sim(True, eos_every=7)
    s.send(generate("a", PROMPT, 40))
    s.run_until_quiescent()
    shown = tuple(s.emitted_tokens("a", 1))
    follow = (*PROMPT, *shown, *b" and more")  # the text shown, then new words (no EOS)
    s.send(generate("b", follow, 8))
    s.run_until_quiescent()
    assert s.emitted_tokens("b", 1) == greedy_continuation(follow, 8, eos_every=7)[:8]
    entries_match_their_states(s)


def test_a_newcomer_waits_for_at_most_the_queued_step_and_both_stay_exact() -> None:
    waits = [_newcomer_wait(pipelined) for pipelined in (False, True)]
    # Behind the one step queued ahead of it, and its own first step is charged when built (the
    # simulated cost model: on MLX building is cheap and the step computes when its token is read).
    assert waits[1] <= waits[0] + 2 * DECODE_S


def _newcomer_wait(pipelined: bool) -> float:
    """Virtual seconds from a newcomer's send to its first token while a stream decodes."""
    s = sim(pipelined)
    s.send(generate("a", PROMPT, 30))
    s.run_until(lambda: len(s.emitted_tokens("a", 1)) >= 3)
    sent = s.clock.now
    s.send(generate("b", tuple(b"jumps over"), 10))
    s.run_until(lambda: bool(s.emitted_tokens("b", 1)))
    wait = s.clock.now - sent
    s.run_until_quiescent()
    assert s.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 30)
    assert s.emitted_tokens("b", 1) == greedy_continuation(tuple(b"jumps over"), 10)
    entries_match_their_states(s)
    return wait


@pytest.mark.parametrize("queued", [False, True], ids=["step-by-step", "queued"])
def test_a_lone_prompts_first_draw_queues_behind_the_chunk_that_ends_it(queued: bool) -> None:
    """On a backend that queues steps, a lone generate's first draw follows its prompt's last
    chunk without a trip through the loop; the output, the entry and the budget are the same."""
    s = sim(False, queue_steps=queued, prefill_s_per_token=0.01)
    s.send(generate("a", PROMPT, 6))
    s.run_until_quiescent()
    assert s.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 6)
    assert engine(s).counters.snapshot().get("first_draws_queued", 0) == int(queued)
    entries_match_their_states(s)
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


def test_a_cancel_during_the_last_chunk_leaves_the_first_draw_queued_behind_it_undone() -> None:
    s = sim(False, queue_steps=True, prefill_s_per_token=0.1)
    s.send(generate("a", PROMPT, 6))
    s.run_until(lambda: any(isinstance(e, Started) for e in s.events("a", 1)))
    s.advance(0.5)  # the prompt's one chunk runs, the first draw queued behind it
    s.send(Cancel(request_id="a", incarnation=1))
    s.run_until_quiescent()
    end = s.terminal("a", 1)
    assert isinstance(end, Cancelled)
    assert s.emitted_tokens("a", 1) == []
    assert end.usage.completion_tokens == 0
    for key in entries_match_their_states(s):
        assert PROMPT[: len(key)] == key  # the prompt or a part of it, never a drawn token
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes
    assert engine(s).counters.snapshot().get("first_draws_queued", 0) == 0


def test_a_prompt_with_company_or_checkpoints_draws_through_the_loop() -> None:
    """Two prompts at once (the second may join a batch), or a prompt with checkpoints to file:
    no first draw is queued."""
    s = sim(False, queue_steps=True, prefill_s_per_token=0.01)
    s.send(generate("a", PROMPT, 4))
    s.send(generate("b", tuple(b"jumps over the lazy dog"), 4))
    s.run_until_quiescent()
    assert s.emitted_tokens("a", 1) == greedy_continuation(PROMPT, 4)
    assert s.emitted_tokens("b", 1) == greedy_continuation(tuple(b"jumps over the lazy dog"), 4)
    assert engine(s).counters.snapshot().get("first_draws_queued", 0) == 0
