"""Taking a cached entry in place instead of copying it (docs/reuse.md, "Taking an entry instead
of copying it"), on the deterministic simulator with ``take_tail_tokens`` set as llama.cpp sets
it: a later prompt that loses at most that many of an unheld entry's tokens takes the entry (it
leaves the prefix cache, its bytes leave the keeper, its state is cut back in place); a longer
tail, or an entry another live request holds, is copied as before. Output equals cold either
way, and the prefix cache's bytes equal the keeper's. Virtual time only: nothing sleeps.
"""

from __future__ import annotations

from collections import Counter

from runtime.backends.contract import SequenceState
from runtime.backends.simulated import greedy_continuation
from runtime.kernel.core import Address
from runtime.messages import Cancel, LookupResult, Message, ModelSpec, ReusePath, Started
from runtime.testing.harness import engine, kv_keeper, make_sim, prefix_cache, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

BPT = 1024
FIXED = 512
TAIL = 8  # take_tail_tokens of every model here
PROMPT = tuple(range(100, 130))  # 30 tokens
MAX_TOKENS = 6
END_STATE = len(PROMPT) + MAX_TOKENS - 1  # the first request's entry: its last token not fed


def spec(**options: object) -> ModelSpec:
    return sim_spec(chunk=4, bytes_per_token=BPT, take_tail_tokens=TAIL, **options)  # type: ignore[arg-type]


def first_request(sim: Simulator) -> list[int]:
    sim.send(generate("a", PROMPT, MAX_TOKENS))
    sim.run_until_quiescent()
    return sim.emitted_tokens("a", 1)


def started(sim: Simulator, request_id: str) -> Started:
    [start] = [e for e in sim.events(request_id, 1) if isinstance(e, Started)]
    return start


def states(sim: Simulator) -> dict[int, tuple[tuple[int, ...], SequenceState]]:
    """The cached entries' tokens and states, by the state's identity."""
    held = {}
    for entry in prefix_cache(sim).entries():
        state = engine(sim).entry_state(entry.entry_id)
        if state is not None:
            held[id(state)] = (entry.tokens, state)
    return held


def in_place(before: dict[int, tuple[tuple[int, ...], SequenceState]], sim: Simulator) -> bool:
    """An entry cached before now holds other tokens in the same state object: its request cut it
    back in place and extended it (a copied one is a new object)."""
    return any(
        key in before and before[key][1] is state and before[key][0] != tokens
        for key, (tokens, state) in states(sim).items()
    )


def counters(sim: Simulator) -> Counter[str]:
    return Counter(engine(sim).counters.snapshot())


def check_exact_bytes(sim: Simulator) -> None:
    """Every byte the keeper holds is an entry's, and every entry's is held."""
    assert prefix_cache(sim).total_bytes == kv_keeper(sim).reserved_bytes
    assert kv_keeper(sim).queued() == ()


def test_the_next_turn_takes_the_whole_entry_in_place() -> None:
    sim = make_sim(spec())
    out = first_request(sim)
    turn2 = (*PROMPT, *out, *range(200, 204))  # contains the whole entry: nothing is lost
    before = states(sim)

    sim.send(generate("b", turn2, MAX_TOKENS))
    sim.run_until_quiescent()

    start = started(sim, "b")
    assert (start.path, start.cached_tokens, start.taken) == (ReusePath.EXACT, END_STATE, True)
    assert sim.emitted_tokens("b", 1) == greedy_continuation(turn2, MAX_TOKENS)
    assert counters(sim)["entries_taken"] == 1
    assert in_place(before, sim)
    # The taken entry is gone; the second request's own entry is the only one left.
    [entry] = prefix_cache(sim).entries()
    assert entry.tokens[: len(turn2)] == turn2
    assert prefix_cache(sim).counters.snapshot()["taken"] == 1
    check_exact_bytes(sim)


def test_a_branch_near_the_end_takes_the_entry_and_a_far_one_copies_it() -> None:
    sim = make_sim(spec())
    first_request(sim)
    near = (*PROMPT[:-3], *range(200, 204))  # loses END_STATE - 27 = 8 tokens: at most TAIL
    far = (*PROMPT[:-10], *range(230, 234))  # would lose 15

    sim.send(generate("far", far, MAX_TOKENS))
    sim.run_until_quiescent()
    assert (started(sim, "far").cached_tokens, started(sim, "far").taken) == (20, False)
    before = states(sim)
    sim.send(generate("near", near, MAX_TOKENS))
    sim.run_until_quiescent()

    start = started(sim, "near")
    assert (start.path, start.cached_tokens, start.taken) == (ReusePath.TRIM, 27, True)
    for request_id, prompt in (("far", far), ("near", near)):
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, MAX_TOKENS)
    assert in_place(before, sim)
    assert counters(sim)["entries_taken"] == 1
    check_exact_bytes(sim)


def test_an_entry_another_live_request_holds_is_copied_not_taken() -> None:
    """Two branches of one entry at once: the first holds a lease on it (a tail too long to take)
    while the second looks up, so the second copies it, and the entry stays cached."""
    sim = make_sim(spec())
    out = first_request(sim)
    holder = (*PROMPT[:10], *range(230, 234))
    near = (*PROMPT, *out[:-1], 7)

    sim.send(generate("holder", holder, MAX_TOKENS))
    sim.send(generate("near", near, MAX_TOKENS))
    sim.run_until_quiescent()

    assert (started(sim, "holder").taken, started(sim, "near").taken) == (False, False)
    assert started(sim, "near").cached_tokens == END_STATE
    assert counters(sim)["entries_taken"] == 0
    for request_id, prompt in (("holder", holder), ("near", near)):
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, MAX_TOKENS)
    assert any(e.tokens == (*PROMPT, *out)[:END_STATE] for e in prefix_cache(sim).entries())
    check_exact_bytes(sim)


def test_a_checkpoint_entry_is_taken_at_a_point_from_its_snapshot() -> None:
    sim = make_sim(spec(trimmable=False, checkpoint_every_tokens=8, fixed_state_bytes=FIXED))
    out = first_request(sim)
    assert 30 in prefix_cache(sim).entries()[0].points  # the end-of-prompt point
    again = (*PROMPT, *range(200, 204))  # restores at 30: the entry loses its 5 last tokens
    before = states(sim)

    sim.send(generate("b", again, MAX_TOKENS))
    sim.run_until_quiescent()

    start = started(sim, "b")
    assert (start.path, start.cached_tokens, start.taken) == (ReusePath.CHECKPOINT, 30, True)
    # The simulated backend checks a snapshot against the state it is restored into.
    assert sim.emitted_tokens("b", 1) == greedy_continuation(again, MAX_TOKENS)
    assert in_place(before, sim)
    assert not any(e.tokens == (*PROMPT, *out)[:END_STATE] for e in prefix_cache(sim).entries())
    check_exact_bytes(sim)


def test_a_model_that_copies_cheaply_never_takes() -> None:
    sim = make_sim(sim_spec(chunk=4, bytes_per_token=BPT))  # take_tail_tokens 0: MLX's
    out = first_request(sim)
    before = states(sim)
    sim.send(generate("b", (*PROMPT, *out, 5), MAX_TOKENS))
    sim.run_until_quiescent()
    assert (started(sim, "b").path, started(sim, "b").taken) == (ReusePath.EXACT, False)
    assert not in_place(before, sim)
    assert len(prefix_cache(sim).entries()) == 2
    check_exact_bytes(sim)


def test_a_takeable_hit_for_a_request_cancelled_meanwhile_stays_cached() -> None:
    """The prefix cache marks the hit takeable, but the request was cancelled before the answer
    reached the engine: nothing was taken (a take is the restore's), so the lease goes back and
    the entry stays cached, its bytes held for it alone."""
    sim = make_sim(spec())
    out = first_request(sim)
    held: list[tuple[Address, Message, Address]] = []
    real = sim.deliver

    def hold_lookup_results(to: Address, message: Message, sender: Address) -> None:
        if isinstance(message, LookupResult) and message.takeable:
            held.append((to, message, sender))
        else:
            real(to, message, sender)

    sim.deliver = hold_lookup_results  # type: ignore[method-assign]
    sim.send(generate("b", (*PROMPT, *out, 5), MAX_TOKENS))
    sim.run_until_quiescent()
    assert len(held) == 1
    sim.send(Cancel(request_id="b", incarnation=1))
    sim.run_until_quiescent()
    sim.deliver = real  # type: ignore[method-assign]
    real(*held[0])
    sim.run_until_quiescent()

    [entry] = prefix_cache(sim).entries()
    assert entry.leases == 0
    assert engine(sim).statistics().gauges["entries"] == 1
    assert counters(sim)["entries_taken"] == 0
    check_exact_bytes(sim)


def test_a_burst_on_one_entry_copies_it_for_each_and_none_runs_cold() -> None:
    """Four prompts extending one cached prompt, sent together: each lookup leases the entry
    before any restore runs, so each restore finds the others holding it and copies; none runs
    cold and the entry stays cached. A take decided at the lookup gave it to the first and left
    the other three cold."""
    sim = make_sim(spec())
    out = first_request(sim)
    prompts = {f"x{i}": (*PROMPT, *out[:-1], 50 + i) for i in range(4)}
    for request_id, prompt in prompts.items():
        sim.send(generate(request_id, prompt, MAX_TOKENS))
    sim.run_until_quiescent()

    for request_id, prompt in prompts.items():
        start = started(sim, request_id)
        assert (start.cached_tokens, start.taken) == (END_STATE, False), request_id
        assert sim.emitted_tokens(request_id, 1) == greedy_continuation(prompt, MAX_TOKENS)
    assert counters(sim)["entries_taken"] == 0
    check_exact_bytes(sim)


def test_a_turn_after_the_others_ended_takes_the_entry_they_copied() -> None:
    """Once no other sequence holds or awaits the entry, the next restore takes it."""
    sim = make_sim(spec())
    out = first_request(sim)
    shared = (*PROMPT, *out[:-1])
    sim.send(generate("x0", (*shared, 50), MAX_TOKENS))
    sim.send(generate("x1", (*shared, 51), MAX_TOKENS))
    sim.run_until_quiescent()
    before = states(sim)
    sim.send(generate("later", (*shared, 52), MAX_TOKENS))
    sim.run_until_quiescent()

    assert started(sim, "later").taken
    assert sim.emitted_tokens("later", 1) == greedy_continuation((*shared, 52), MAX_TOKENS)
    assert in_place(before, sim)
    check_exact_bytes(sim)
