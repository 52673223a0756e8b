"""Cold or turn-2 TTFT of ours on llama.cpp against llama-server, in paired rounds (issue 22).

Both servers run at once (the bench's launcher and commands, bench/llamacpp.py) and take turns,
the first alternating; each round sends both the same fresh prompt (``cold``: ~N tokens, one
token back; ``warm``: that prompt with an 8-token reply, then turn 2 = it + the reply + a
~14-token follow-up, whose TTFT counts). Prints the median of the per-round ratios of TTFT and of
each server's own prompt time (``timings.prompt_ms``), each side's medians, and every round's
TTFT ratio: more rounds than a bench row's three, for a ratio near 1.0. Not a test.

    .venv/bin/python scripts/llamacpp_ttft_pairs.py smollm2 --turn warm --rounds 12
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence

from bench import llamacpp
from bench.http_client import Reply, Server, complete, in_turn
from bench.models import load_bench_model
from bench.prompts import make_text
from bench.serving import ServerCommand, running

SYSTEMS = (llamacpp.LLAMA_SERVER, llamacpp.OURS_LLAMACPP)


async def _rounds(
    servers: Sequence[Server], tokenizer: object, turn: str, rounds: int, tokens: int
) -> dict[str, list[Reply]]:
    for server in servers:
        await complete(server, make_text(tokenizer, 16, 1), 2)
    got: dict[str, list[Reply]] = {server.system: [] for server in servers}
    for r in range(rounds):
        prompt = make_text(tokenizer, tokens, 7000 + r)
        for server in in_turn(servers, r):
            if turn == "cold":
                got[server.system].append(await complete(server, prompt, 1))
                continue
            first = await complete(server, prompt, 8)
            follow = make_text(tokenizer, 14, 9000 + r)
            got[server.system].append(await complete(server, prompt + first.text + follow, 1))
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=["smollm2", "gemma3"])
    parser.add_argument("--turn", choices=["cold", "warm"], default="cold")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args()
    model = load_bench_model(args.model)
    found = llamacpp.find(set(SYSTEMS))
    commands = [found.command(system, model) for system in SYSTEMS]
    for command in commands:
        if not isinstance(command, ServerCommand):
            raise SystemExit(f"cannot run: {command.reason}")
    with running([c for c in commands if isinstance(c, ServerCommand)]) as servers:
        got = asyncio.run(_rounds(servers, model.tokenizer, args.turn, args.rounds, args.tokens))
    ours, theirs = got[llamacpp.OURS_LLAMACPP], got[llamacpp.LLAMA_SERVER]

    def ms(values: Sequence[float]) -> str:
        return f"{statistics.median(values) * 1000:.1f} ms"

    def evals(replies: list[Reply]) -> list[float]:
        return [r.prompt_eval_s or 0.0 for r in replies]

    ttft = [a.ttft / b.ttft for a, b in zip(ours, theirs, strict=True)]
    evaluated = [a / b for a, b in zip(evals(ours), evals(theirs), strict=True) if b]
    print(f"{args.model} {args.turn}, {args.rounds} rounds, ours over llama-server:")
    print(f"  TTFT {statistics.median(ttft):.3f}x, prompt time {statistics.median(evaluated):.3f}x")
    for name, replies in (("ours", ours), ("llama-server", theirs)):
        rest = [r.ttft - e for r, e in zip(replies, evals(replies), strict=True)]
        print(
            f"  {name}: TTFT {ms([r.ttft for r in replies])}, prompt time "
            f"{ms(evals(replies))}, the rest {ms(rest)}"
        )
    print("  per round:", " ".join(f"{x:.2f}" for x in ttft))


if __name__ == "__main__":
    main()
