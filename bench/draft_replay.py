"""Prompt lookup replayed on a model's greedy text: how many passes each speculative workload
takes, independent of how busy the machine is.

The speculative group times decoding, which on a shared 2-core machine moves by +-30%. Drafting
is deterministic given the greedy text, so this replays each workload's greedy tokens (raw
mlx-lm) through the runtime's own ``Speculation`` as the engine drives it: a pass verifies the
drafts, accepts up to the first rejection and adds one token of its own. It prints the passes,
the plain steps, the drafts accepted, and the cost model's speedup over plain decoding (a pass of
k drafts costs ``drafting.pass_cost(k + 1)`` one-token passes): a change to drafting is compared
here first, then timed. With ``--show`` it prints each workload's text with every token marked:
``[...]`` accepted drafts, ``{...}`` a pass's own token after its drafts (``/r``: r drafts
rejected), bare text a plain step's token.
``python -m bench.draft_replay [model] [max_tokens] [--show]``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.engine.drafting import Speculation, pass_cost
from bench.models import load_bench_model
from bench.speculative import DRAFTS, WORKLOADS, _prompt, banned_ends, raw_rate


@dataclass
class Replay:
    """What decoding ``greedy`` took: passes, drafts, the cost in one-token passes, and each
    pass's (first token's index, accepted drafts, drafts) for ``marked``."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    cost: float = 0.0
    blocks: list[tuple[int, int, int]] = field(default_factory=list)

    def marked(self, greedy: list[int], decode: Callable[[list[int]], str]) -> str:
        """``greedy`` as text with each token marked (module docstring)."""
        out = []
        for start, accepted, drafted in self.blocks:
            if not drafted:
                out.append(decode(greedy[start : start + 1]))
                continue
            if accepted:
                out.append(f"[{decode(greedy[start : start + accepted])}]")
            own = decode(greedy[start + accepted : start + accepted + 1])
            rejected = drafted - accepted
            out.append(f"{{{own}}}" + (f"/{rejected}" if rejected else ""))
        return "".join(out)


def replay(prompt: list[int], greedy: list[int], most: int = DRAFTS) -> Replay:
    """Decode ``greedy`` after ``prompt`` with prompt-lookup speculation, as the engine's
    pipelined B=1 path does (actors/engine/decode.py): a plain step builds the next one before
    its token is read unless the history's end already promised drafts (``expects_drafts``), and
    only a step not built ahead asks for drafts."""
    speculation = Speculation(most)
    history, done, result = list(prompt), 0, Replay()
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
        result.cost += pass_cost(len(drafts) + 1)
        result.blocks.append((done, accepted, len(drafts)))
        history += greedy[done : done + accepted + 1]
        done += accepted + 1
        result.passes += 1
    result.drafted, result.accepted = speculation.drafted, speculation.accepted
    return result


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    show = "--show" in sys.argv
    name = args[0] if args else "smollm2"
    max_tokens = int(args[1]) if len(args) > 1 else 96
    bench = load_bench_model(name)
    bias = banned_ends(bench.tokenizer)
    ends = set(bench.tokenizer.eos_token_ids)
    print(f"model {name}, {max_tokens} greedy tokens")
    print(
        f"{'workload':20} {'tokens':>6} {'steps':>6} {'plain':>6} {'accepted':>9} {'modelled':>8}"
    )
    for workload in WORKLOADS:
        prompt = _prompt(bench.tokenizer, workload)
        _, greedy = raw_rate(bench.model, prompt, max_tokens, ends, bias)
        done = replay(prompt, greedy)
        plain = sum(1 for _, _, drafted in done.blocks if not drafted)
        speedup = len(greedy) / done.cost if done.cost else 0.0
        print(
            f"{workload:20} {len(greedy):6} {done.passes:6} {plain:6} "
            f"{done.accepted:4}/{done.drafted:<4} {speedup:7.2f}x"
        )
        if show:
            print(done.marked(greedy, bench.tokenizer.decode), end="\n\n")


if __name__ == "__main__":
    main()
