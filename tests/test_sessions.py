"""Sessions pin their instructions prefix in the prefix cache while they live."""

from __future__ import annotations

from runtime.messages import (
    ChatMessage,
    EndSession,
    Evict,
    Finished,
    Generate,
    SessionEnded,
    Started,
)
from runtime.testing.harness import kv_keeper, make_sim, prefix_cache, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

SYSTEM = ChatMessage(role="system", content="You are a careful assistant.")
RENDERED_SYSTEM = len("system: You are a careful assistant.\n")


def chat(request_id: str, incarnation: int, system: ChatMessage, text: str) -> Generate:
    return generate(
        request_id,
        max_tokens=3,
        incarnation=incarnation,
        messages=(system, ChatMessage(role="user", content=text)),
        session="s",
    )


def pinned(sim: Simulator) -> list[int]:
    return [len(e.tokens) for e in prefix_cache(sim).entries() if e.pinned]


def test_the_instructions_prefix_is_pinned_reused_and_replaced_when_it_changes() -> None:
    sim = make_sim(sim_spec(chunk=16, trimmable=False), reservation_timeout_s=1.0)
    sim.send(chat("a", 1, SYSTEM, "first question"))
    sim.run_until_quiescent()
    assert pinned(sim) == [RENDERED_SYSTEM]
    sim.send(chat("b", 2, SYSTEM, "a different question"))
    sim.run_until_quiescent()
    started = next(e for e in sim.events("b", 2) if isinstance(e, Started))
    assert started.cached_tokens == RENDERED_SYSTEM  # another conversation reuses the pin
    assert pinned(sim) == [RENDERED_SYSTEM]  # still one pin: nothing duplicated
    other = ChatMessage(role="system", content="Be terse.")
    sim.send(chat("c", 3, other, "first question"))
    sim.run_until_quiescent()
    assert pinned(sim) == [len("system: Be terse.\n")]  # the old prefix was unpinned
    reply = sim.ask(EndSession(model="m", session="s"))
    assert reply == SessionEnded(model="m", session="s", unpinned=True)
    assert pinned(sim) == []


def test_a_pinned_prefix_survives_ordinary_eviction_but_never_starves_a_reservation() -> None:
    # Budget: the pinned prefix plus one running request, but not two of them.
    model = sim_spec(chunk=16, bytes_per_token=1024)
    sim = make_sim(model, budget=120 * 1024, reservation_timeout_s=1.0)
    sim.send(chat("a", 1, SYSTEM, "q"))
    sim.run_until_quiescent()
    assert pinned(sim) == [RENDERED_SYSTEM]
    sim.deliver("prefix", Evict(nbytes=1 << 30), "kv")  # ordinary pressure: pins stay
    sim.run_until_quiescent()
    assert pinned(sim) == [RENDERED_SYSTEM]
    # A request too big to fit beside the pin: half-way to its deadline the pin is evicted.
    big = generate("big", max_tokens=40, incarnation=2, prompt="x" * 60)
    sim.send(big)
    sim.run_until_quiescent()
    assert isinstance(sim.terminal("big", 2), Finished)
    assert pinned(sim) == []
    assert kv_keeper(sim).statistics().counters["evict_pinned_requests"] >= 1
