"""Prewarms that race each other, on the simulator: what each prefills and how each ends.

Issue 11 measured, before these rules: a second prewarm of the same session ran beside the first
(both prompts prefilled whole), and four identical concurrent prewarms each prefilled the prompt
(4 x 199 tokens, three commits refused as duplicates). Now a prewarm supersedes its session's older
prewarm or adopts the one it extends, and identical ones compute once (docs/protocols.md,
"Prewarm supersede / adopt").
"""

from __future__ import annotations

from runtime.backends.simulated import greedy_continuation
from runtime.messages import (
    Cancel,
    Cancelled,
    Finished,
    FinishReason,
    ReusePath,
    Started,
    Usage,
)
from runtime.testing.harness import engine, kv_keeper, make_sim, prefix_cache, sim_spec
from runtime.testing.requests import generate, prewarm
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001
CHUNK = 16
FIRST = tuple(range(50, 250))  # 200 tokens: a prewarm prefills 199, in 13 chunks
OTHER = tuple(range(249, 49, -1))  # 200 others
THIRD = tuple((3 * i + 1) % 256 for i in range(200))


def sim() -> Simulator:
    return make_sim(
        sim_spec(chunk=CHUNK, prefill_s_per_token=PER_TOKEN, decode_s_per_token=PER_TOKEN)
    )


def finished(s: Simulator, request_id: str) -> Finished:
    terminal = s.terminal(request_id, 1)
    assert isinstance(terminal, Finished), terminal
    return terminal


def cancelled(s: Simulator, request_id: str) -> Cancelled:
    terminal = s.terminal(request_id, 1)
    assert isinstance(terminal, Cancelled), terminal
    return terminal


def entry_lengths(s: Simulator) -> list[int]:
    return sorted(len(entry.tokens) for entry in prefix_cache(s).entries())


def test_a_new_prewarm_of_the_session_supersedes_the_older_one_at_its_next_chunk() -> None:
    s = sim()
    s.send(prewarm("focus-1", FIRST, session="editor"))
    s.advance(CHUNK * PER_TOKEN * 3.5)  # inside its fourth chunk
    s.send(prewarm("focus-2", OTHER, session="editor"))
    s.run_until_quiescent()
    assert cancelled(s, "focus-1").reason == "superseded"
    assert finished(s, "focus-2").reason is FinishReason.PREWARMED
    # The older one's finished chunks are kept as an entry; nothing else of it was computed.
    kept, warmed = entry_lengths(s)
    assert warmed == 199 and kept % CHUNK == 0 and 0 < kept <= 5 * CHUNK
    counters = engine(s).counters
    assert counters["prefilled_tokens"] == 199 + kept  # was 398: both prefilled whole
    assert counters["prewarms_superseded"] == 1
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


def test_a_new_prewarm_that_extends_the_older_one_adopts_it() -> None:
    s = sim()
    longer = (*FIRST, *THIRD[:100])
    s.send(prewarm("focus-1", FIRST, session="editor"))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    s.send(prewarm("focus-2", longer, session="editor"))
    s.run_until_quiescent()
    assert finished(s, "focus-1").reason is FinishReason.ADOPTED
    assert finished(s, "focus-2").reason is FinishReason.PREWARMED
    started = next(e for e in s.events("focus-2", 1) if isinstance(e, Started))
    assert started.path is ReusePath.ADOPTED and started.cached_tokens > 0
    assert engine(s).counters["prefilled_tokens"] == 299  # once, through the adopted state
    assert entry_lengths(s) == [299]


def test_a_session_name_in_another_namespace_is_another_session() -> None:
    """Two cache salts (or two API keys' tenants) that both name a session "editor": the newer
    prewarm neither adopts nor supersedes the other's, which would hand one namespace's state to
    the other or cut the other's work short."""
    s = sim()
    longer = (*FIRST, *THIRD[:100])
    s.send(prewarm("focus-1", FIRST, session="editor", namespace="a"))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    s.send(prewarm("focus-2", longer, session="editor", namespace="b"))
    s.run_until_quiescent()
    assert finished(s, "focus-1").reason is FinishReason.PREWARMED
    assert finished(s, "focus-2").reason is FinishReason.PREWARMED
    started = next(e for e in s.events("focus-2", 1) if isinstance(e, Started))
    assert started.path is not ReusePath.ADOPTED and started.cached_tokens == 0
    assert engine(s).counters["prefilled_tokens"] == 199 + 299  # each prefilled its own


def test_identical_concurrent_prewarms_prefill_once_and_all_finish_prewarmed() -> None:
    s = sim()
    s.send(prewarm("a", FIRST))
    s.send(prewarm("b", FIRST))  # the same (default) session
    s.send(prewarm("c", FIRST, session="another-session"))
    s.send(prewarm("d", FIRST, anonymous=True))
    s.run_until_quiescent()
    leader, *followers = (finished(s, r) for r in "abcd")
    assert leader.reason is FinishReason.PREWARMED
    assert leader.usage == Usage(prompt_tokens=200, cached_prompt_tokens=0)
    for follower in followers:  # computed nothing: the cached entry holds all of it
        assert follower.reason is FinishReason.PREWARMED
        assert follower.usage == Usage(prompt_tokens=200, cached_prompt_tokens=199)
    counters = engine(s).counters
    assert counters["prefilled_tokens"] == 199  # was 796
    assert counters["entries_committed"] == 1  # was 4, three refused as duplicates
    assert counters["prewarms_deduplicated"] == 3
    assert counters["prewarms_superseded"] == 0
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


def test_followers_of_a_cancelled_prewarm_go_on_from_where_it_stopped() -> None:
    s = sim()
    s.send(prewarm("a", FIRST, session="client-a"))
    s.send(prewarm("b", FIRST, session="client-b"))
    s.send(prewarm("c", FIRST, session="client-c"))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    s.send(Cancel(request_id="a", incarnation=1))
    s.run_until_quiescent()
    assert cancelled(s, "a").reason == "cancelled"
    b, c = finished(s, "b"), finished(s, "c")
    assert b.reason is c.reason is FinishReason.PREWARMED
    counters = engine(s).counters
    # "b" goes on from the entry "a" left, "c" follows "b": the prompt is still prefilled once.
    assert counters["prefilled_tokens"] == 199
    assert counters["followers_let_go"] == 1
    assert 0 < b.usage.cached_prompt_tokens < 199
    assert c.usage.cached_prompt_tokens == 199
    assert kv_keeper(s).reserved_bytes == prefix_cache(s).total_bytes


def test_a_leaders_own_session_supersedes_it_but_not_the_prewarms_that_follow_it() -> None:
    s = sim()
    s.send(prewarm("a", FIRST, session="client-a"))
    s.send(prewarm("b", FIRST, session="client-b"))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    s.send(prewarm("a2", OTHER, session="client-a"))
    s.run_until_quiescent()
    assert cancelled(s, "a").reason == "superseded"
    assert finished(s, "b").reason is FinishReason.PREWARMED
    assert finished(s, "a2").reason is FinishReason.PREWARMED
    assert engine(s).counters["prefilled_tokens"] == 199 + 199


def test_a_generate_that_adopts_a_leader_takes_its_followers_work_too() -> None:
    s = sim()
    s.send(prewarm("a", FIRST, session="editor"))
    s.send(prewarm("b", FIRST, session="editor"))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    prompt = (*FIRST, 7, 8)
    s.send(generate("g", prompt, 2, session="editor"))
    s.run_until_quiescent()
    assert finished(s, "a").reason is FinishReason.ADOPTED
    assert finished(s, "b").reason is FinishReason.ADOPTED
    assert s.emitted_tokens("g", 1) == greedy_continuation(prompt, 2)
    assert engine(s).counters["prefilled_tokens"] == len(prompt)


def test_anonymous_requests_supersede_nothing_and_are_never_superseded() -> None:
    s = sim()
    s.send(prewarm("a", FIRST, anonymous=True))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    s.send(prewarm("b", OTHER, anonymous=True))  # another client: both run
    s.send(generate("g", (1, 2, 3), 2))
    s.run_until_quiescent()
    assert finished(s, "a").reason is FinishReason.PREWARMED
    assert finished(s, "b").reason is FinishReason.PREWARMED
    assert engine(s).counters["prewarms_superseded"] == 0
    # An anonymous generate still adopts the in-flight prewarm its prompt extends.
    s.send(prewarm("c", THIRD, anonymous=True))
    s.advance(CHUNK * PER_TOKEN * 3.5)
    prompt = (*THIRD, 9)
    s.send(generate("h", prompt, 2, anonymous=True))
    s.run_until_quiescent()
    assert finished(s, "c").reason is FinishReason.ADOPTED
    assert s.emitted_tokens("h", 1) == greedy_continuation(prompt, 2)
