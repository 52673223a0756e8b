"""Routing across replicas (actors/replicas.py, protocols.md "Replicas and routing") under drawn
programs: requests with and without sessions over prompts that share prefixes, prewarms, lost
engine processes, in an actor order Hypothesis draws.

Invariants: every request ends exactly once and nothing follows its end; a request starts at most
once (a move happens before its start, so the host never sees it twice); while no replica was lost
a session's requests (its prewarms included) all start on one replica; at quiescence the
keeper holds exactly the prefix entries' bytes and nothing of an epoch no engine runs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import example, given
from hypothesis import strategies as st

from runtime.host.config import RuntimeConfig
from runtime.kernel.core import Address
from runtime.messages import (
    Cancelled,
    Failed,
    Finished,
    ModelSpec,
    Rejected,
    Started,
)
from runtime.testing.harness import engine_address_of, engines, kv_keeper, prefix_cache
from runtime.testing.requests import generate, prewarm
from runtime.testing.simulator import Simulator

OPTIONS = {"prefill_s_per_token": 0.0002, "decode_s_per_token": 0.001}
SPEC = ModelSpec(name="m", backend="simulated", options=OPTIONS, replicas=2)
BASES = (tuple(range(100, 140)), tuple(range(200, 260)), (7, 8, 9))
SESSIONS = (None, "s1", "s2")

send = st.tuples(
    st.sampled_from(["generate", "prewarm"]),
    st.sampled_from(SESSIONS),
    st.sampled_from(BASES),
    st.lists(st.integers(1, 50), max_size=20).map(tuple),
    st.integers(1, 20),
)
lose = st.tuples(st.just("lose"), st.integers(0, 1))
wait = st.tuples(st.just("advance"), st.sampled_from([0.0, 0.005, 0.05]))
programs = st.lists(st.one_of(send, send, send, send, lose, wait), min_size=1, max_size=14)


class DrawnOrder:
    def __init__(self, drawn: random.Random) -> None:
        self._drawn = drawn

    def choice(self, seq: Sequence[Address], /) -> Address:
        return seq[0] if len(seq) == 1 else self._drawn.choice(seq)


# A session's turns sent together: least busy alone would split them across the replicas.
TOGETHER = [("generate", "s1", BASES[2], (i,), 5) for i in range(3)]


@given(program=programs, order=st.randoms(use_true_random=False))
@example(program=TOGETHER, order=random.Random(0))
def test_routing_keeps_sessions_ends_once_and_gives_everything_back(
    program: list[tuple[object, ...]], order: random.Random
) -> None:
    sim = Simulator(config=RuntimeConfig(kv_budget_bytes=64 << 20), order=DrawnOrder(order))
    sim.load(SPEC)
    replica_of_epoch: dict[int, str] = {}
    sim.check_every_step(lambda: replica_of_epoch.update({e.epoch: e.model for e in engines(sim)}))
    sent: list[tuple[str, str | None]] = []
    lost_at: list[int] = []  # how many host messages had come when a replica was lost
    for i, action in enumerate(program):
        match action:
            case ("generate" | "prewarm") as kind, session, base, tail, n:
                rid = f"r{i}"
                prompt = (*base, *tail)  # type: ignore[misc]
                if kind == "generate":
                    sim.send(generate(rid, prompt, n, session=session))  # type: ignore[arg-type]  # fmt: skip
                else:
                    sim.send(prewarm(rid, prompt, session=session))  # type: ignore[arg-type]  # fmt: skip
                sent.append((rid, session))  # type: ignore[arg-type]
            case "lose", index:
                try:
                    address = engine_address_of(sim, f"m@{index}")
                except LookupError:
                    continue  # that replica is restarting, or out of service
                sim.lose_engine(address)
                lost_at.append(len(sim.host_messages))
            case "advance", seconds:
                sim.advance(seconds)  # type: ignore[arg-type]
    sim.run_until_quiescent()

    before_loss = sim.host_messages[: lost_at[0]] if lost_at else sim.host_messages
    started_before_loss = {m.request_id for m in before_loss if isinstance(m, Started)}
    replica_of_session: dict[str, str] = {}
    for rid, session in sent:
        events = sim.events(rid, 1)
        ends = [e for e in events if isinstance(e, Finished | Cancelled | Failed | Rejected)]
        assert len(ends) == 1 and events[-1] is ends[0], events
        starts = [e for e in events if isinstance(e, Started)]
        assert len(starts) <= 1, events
        if not starts or session is None:
            continue
        replica = replica_of_epoch[starts[0].epoch]
        if rid in started_before_loss:  # no replica was lost yet: its session is on one
            assert replica_of_session.setdefault(session, replica) == replica, (session, events)
    kv, prefix = kv_keeper(sim), prefix_cache(sim)
    assert kv.reserved_bytes == prefix.total_bytes
    running = {engine.epoch for engine in engines(sim)}
    assert {holder.epoch for holder in kv.holdings()} <= running
