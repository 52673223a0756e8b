"""The existing scenarios drive a model's servers in turns (bench/server.py): each repetition goes
to every server before the next, the first server alternating, and each server's rows come only
from its own replies."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench import server as bench_server
from bench.http_client import Reply, Server
from bench.workload import Prompt, Sizes, Workload

REPS = 3


def _prompts(kind: str) -> list[Prompt]:
    return [Prompt(f"{kind}{rep}", ()) for rep in range(REPS)]


WORK = Workload(
    sizes=Sizes(repetitions=REPS, reply_tokens=2, decode_tokens=4),
    conversations=_prompts("turn"),
    followups=_prompts("+follow"),
    longs=_prompts("long"),
    longs_abandoned=_prompts("dropped"),
    shorts_idle=_prompts("idle"),
    shorts_after=_prompts("after"),
    decode=_prompts("decode"),
    warmup=Prompt("warmup", ()),
)
SERVERS = [Server("a-server", 1, "m"), Server("b-server", 2, "m")]
TTFT_S = {"a-server": 0.1, "b-server": 0.2}  # each server's replies, told apart in its rows


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []

    async def complete(server: Server, text: str, max_tokens: int, **_: Any) -> Reply:
        calls.append((server.system, text))
        ttft = TTFT_S[server.system]
        reply = Reply(chunks=[(ttft, "x"), (ttft + 0.1, "y")])
        reply.usage = {"prompt_tokens": 10, "completion_tokens": 2}
        reply.timings = {"prompt_ms": ttft * 500, "prompt_n": 4}
        return reply

    async def abandoned_then_short(server: Server, long: str, short: str, delay_s: float) -> float:
        calls.append((server.system, long))
        calls.append((server.system, short))
        return TTFT_S[server.system]

    monkeypatch.setattr(bench_server, "complete", complete)
    monkeypatch.setattr(bench_server, "abandoned_then_short", abandoned_then_short)
    monkeypatch.setattr(bench_server, "THINK_TIME_S", 0.0)
    return calls


def test_each_repetition_visits_every_server_the_first_alternating(
    sent: list[tuple[str, str]],
) -> None:
    rows = asyncio.run(bench_server._measure(SERVERS, "m", WORK))
    assert sent[:2] == [("a-server", "warmup"), ("b-server", "warmup")]
    # Who goes first in each repetition of each scenario, by the prompt that opens it.
    for kind in ("turn", "long", "decode"):
        firsts = [
            [system for system, text in sent if text == f"{kind}{rep}"] for rep in range(REPS)
        ]
        assert firsts == [
            ["a-server", "b-server"],
            ["b-server", "a-server"],
            ["a-server", "b-server"],
        ]
        # A repetition ends on every server before the next begins.
        at = [[i for i, (_, text) in enumerate(sent) if text == f"{kind}{r}"] for r in range(REPS)]
        assert all(max(at[r]) < min(at[r + 1]) for r in range(REPS - 1))
    by_key = {(r.system, r.scenario): r for r in rows}
    assert by_key[("a-server", "turn2.cold_ttft")].value == pytest.approx(100.0)
    assert by_key[("b-server", "turn2.cold_ttft")].value == pytest.approx(200.0)
    assert by_key[("b-server", "turn2.warm_ttft.eval")].value == pytest.approx(100.0)
    assert by_key[("a-server", "turn2.prefilled_warm")].value == 4.0
    assert {r.system for r in rows} == {"a-server", "b-server"}


def test_a_server_that_cannot_start_skips_every_system_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Refused:
        def __enter__(self) -> None:
            raise bench_server.ServerUnavailable("it did not answer /health")

        def __exit__(self, *exc: object) -> None:
            return None

    monkeypatch.setattr(bench_server, "running", lambda commands: Refused())
    commands = [
        bench_server.ServerCommand("a-server", ("a",), "m"),
        bench_server.ServerCommand("b-server", ("b",), "m"),
    ]
    rows = bench_server.measure(commands, "m", WORK)
    assert [(r.system, r.scenario) for r in rows] == [
        ("a-server", "skipped"),
        ("b-server", "skipped"),
    ]
    assert all("it did not answer /health" in (r.note or "") for r in rows)
