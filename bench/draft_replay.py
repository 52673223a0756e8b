"""Prompt lookup replayed on a model's greedy text: how many passes each speculative workload
takes, independent of how busy the machine is.

The speculative group times decoding, which on a shared 2-core machine moves by +-30%. Drafting
is deterministic given the greedy text, so this replays each workload's greedy tokens (raw
mlx-lm) through the runtime's own ``Speculation`` as the engine drives it: a pass verifies the
drafts, accepts up to the first rejection and adds one token of its own. It prints the passes,
the drafts accepted, and the cost model's speedup over plain decoding (a pass of k drafts costs
1 + slope x k one-token passes, ``drafting.DEFAULT_SLOPE``): a change to drafting is compared
here first, then timed. ``python -m bench.draft_replay [model] [max_tokens]``.
"""

from __future__ import annotations

import sys

from actors.engine.drafting import DEFAULT_SLOPE, Speculation
from bench.models import load_bench_model
from bench.speculative import DRAFTS, WORKLOADS, _prompt, banned_ends, raw_rate


def replay(prompt: list[int], greedy: list[int], most: int = DRAFTS) -> tuple[int, int, int, float]:
    """(forward passes, drafted, accepted, cost in one-token passes) to decode ``greedy`` after
    ``prompt`` with prompt-lookup speculation.

    As the engine's pipelined B=1 path does (actors/engine/decode.py): a plain step builds the
    next one before its token is read unless the history's end already promised drafts
    (``expects_drafts``), and only a step not built ahead asks for drafts."""
    speculation = Speculation(most)
    history, done, passes, cost = list(prompt), 0, 0, 0.0
    built_ahead = False
    while done < len(greedy):
        room = len(greedy) - done - 1
        drafts = speculation.drafts(history, room) if room > 0 and not built_ahead else []
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[done + accepted]:
            accepted += 1
        if drafts:
            speculation.passed(len(drafts), accepted)
            built_ahead = False
        else:
            speculation.decoded_plainly()
            built_ahead = not speculation.expects_drafts(history, room)
        cost += 1.0 + DEFAULT_SLOPE * len(drafts)
        history += greedy[done : done + accepted + 1]
        done += accepted + 1
        passes += 1
    return passes, speculation.drafted, speculation.accepted, cost


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2"
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    bench = load_bench_model(name)
    bias = banned_ends(bench.tokenizer)
    ends = set(bench.tokenizer.eos_token_ids)
    print(f"model {name}, {max_tokens} greedy tokens, slope {DEFAULT_SLOPE}")
    print(f"{'workload':20} {'tokens':>6} {'steps':>6} {'accepted':>9} {'modelled':>8}")
    for workload, text in WORKLOADS.items():
        prompt = _prompt(bench.tokenizer, text)
        _, greedy = raw_rate(bench.model, prompt, max_tokens, ends, bias)
        passes, drafted, accepted, cost = replay(prompt, greedy)
        speedup = len(greedy) / cost if cost else 0.0
        print(f"{workload:20} {len(greedy):6} {passes:6} {accepted:4}/{drafted:<4} {speedup:7.2f}x")


if __name__ == "__main__":
    main()
