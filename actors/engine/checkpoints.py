"""Where to snapshot a sequence whose cache cannot be trimmed (sliding-window or recurrent layers).

Such a cache can only be reused whole, so the engine snapshots it at the token counts a later prompt
is most likely to share with this one (the order of preference is at the constants below) and every
*spacing* tokens. The spacing weighs what a snapshot costs (``ModelInfo.snapshot_bytes``) against
the full-attention KV its tokens add, so periodic checkpoints at most double a prompt's KV;
``MAX_POINTS`` and ``BUDGET_SHARE`` cap one prefill's snapshots. The engine snapshots a generation's
end, and where an aborted prefill stopped, itself. No point falls inside a run of an image's soft
tokens (``media.inside_span``). The policy, with figures: docs/design.md, "Prefix reuse and
checkpoints"; docs/reuse.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.backends.contract import ModelInfo, ReuseStrategy
from runtime.backends.vision.media import inside_span

# The points, in order of preference, and the prompt each serves:
# 1. the end of the prompt, where a generate's prefill ends anyway, so the snapshot costs no pass
#    of its own (a next turn whose reply was re-rendered or edited: all the prompt kept). Not one
#    token before it: on llama.cpp and MLX a pass cut there runs the last token alone, which costs
#    about a decode step (Gemma 3 270M on llama.cpp, 2 threads: 27 ms, a 16-token prompt's
#    whole pass 35); the same prompt again restores at point 2 or 3 and runs its few last tokens
#    in one pass, which costs about the same as one token;
# 2. the last word boundary before the end (a person typing re-tokenizes the last word);
# 3. the starts of the last LINE_STARTS lines within BRANCH_REACH of the end, latest first (a
#    prompt re-sent with its last line changed; a chat message ends a line);
# 4. the end of the instructions (another conversation with the same system message);
# 5. the end of each chat message but the last, latest first (an edited or regenerated message);
# 6. BRANCH_REACH tokens before the end (an edit near the end, as far as llama.cpp's rings rewind);
# 7. every spacing tokens. Past MAX_POINTS or the budget share, the least preferred of the others
#    go and the spacing doubles until its points fit (staying multiples of the denser spacing).
WORD_SCAN_TOKENS = 32  # how far back to look for the last word boundary
BRANCH_REACH = 512  # line starts are looked for this far back, and a point sits this far back
LINE_STARTS = 3  # line starts near the end: the generation prompt's, and the last two lines'
MIN_SPACING = 64  # on a recurrent state each checkpoint ends a pass: at most 4 per 256 tokens
# A periodic point this close (a share of the spacing) to a preferred one, the cached start or the
# prefill's end is left out: each point ends a pass, and a pass costs a read of every weight
# however few its rows (Gemma 3 on llama.cpp: 23 rows after a cut at 489 took 50 ms, as long as
# 30 rows' share of a 512-row pass), while the nearby point serves the same prompts.
PERIODIC_GAP_SHARE = 8
MAX_POINTS = 32  # snapshots of one prefill, so a long prompt cannot flood the prefix cache
BUDGET_SHARE = 32  # one prefill's snapshots take at most 1/32 of the KV budget
_ANCHORS = 3 + LINE_STARTS  # points 1-4 above: at most one each, and the line starts


@dataclass(frozen=True)
class CheckpointRule:
    """How one prefill is checkpointed: the periodic spacing (0: none) and the most snapshots."""

    spacing: int
    most: int


@dataclass(frozen=True)
class CheckpointPolicy:
    """An engine's checkpoint rules: its model's ``checkpoint_every_tokens`` and the KV budget."""

    widest: int  # the periodic spacing never exceeds this (0: no periodic checkpoints)
    budget_bytes: int

    def spacing(self, info: ModelInfo) -> int:
        """The periodic spacing on this model (see the module docstring)."""
        if self.widest <= 0:
            return 0
        if info.bytes_per_token <= 0:  # a constant-size state: only the caps weigh against it
            return min(self.widest, MIN_SPACING)
        tokens = max(MIN_SPACING, -(-info.snapshot_bytes // info.bytes_per_token))
        return min(self.widest, 1 << (tokens - 1).bit_length())

    def rule(
        self,
        info: ModelInfo,
        target: int,
        message_ends: int,
        free_bytes: int,
        *,
        longest: int | None = None,
    ) -> CheckpointRule | None:
        """The rule of a prefill of ``target`` tokens with ``message_ends`` known message ends,
        whose snapshots fit in ``free_bytes``; None when the model's cache trims instead, or when
        the sequence, at most ``longest`` tokens with its reply (None: not known), stays under
        ``ModelInfo.trims_below``: its state still trims when it ends, so snapshots would buy
        nothing and each point would cost a pass (on Gemma 3 on llama.cpp a 400-token prompt ran
        as 400 rows and 1, the 1-row pass 27-37 ms)."""
        if info.reuse is not ReuseStrategy.CHECKPOINT:
            return None
        if longest is not None and longest < info.trims_below:
            return None
        spacing = self.spacing(info)
        reach = 1 if target >= BRANCH_REACH else 0  # point 6 lies inside a prompt this long only
        wanted = _ANCHORS + reach + message_ends + periodic_count(0, target, spacing)
        most = min(MAX_POINTS, wanted, max(target, 0))  # no more points than tokens
        if info.snapshot_bytes > 0:
            affordable = min(self.budget_bytes // BUDGET_SHARE, max(free_bytes, 0))
            most = min(most, affordable // info.snapshot_bytes)
        return CheckpointRule(spacing, most)


def periodic_count(start: int, target: int, spacing: int) -> int:
    """How many multiples of ``spacing`` lie strictly between ``start`` and ``target``."""
    if spacing <= 0 or target <= start:
        return 0
    return (target - 1) // spacing - start // spacing


def plan_checkpoints(
    tokens: Sequence[int],
    start: int,
    target: int,
    decode: Callable[[Sequence[int]], str],
    rule: CheckpointRule,
    *,
    message_ends: Sequence[int] = (),
    instructions_end: int = 0,
) -> list[int]:
    """Sorted token counts after ``start`` (cached) to snapshot at: strictly before ``target``,
    or at it where it is the whole prompt (point 1); at most ``rule.most``, the preferred ones
    first (see the module docstring)."""
    end_of_prompt = len(tokens)
    preferred = [end_of_prompt]
    last = end_of_prompt - 1
    for index in range(last, max(start, last - WORD_SCAN_TOKENS), -1):
        if decode([tokens[index]])[:1].isspace():
            preferred.append(index)  # the state just before the last word began
            break
    preferred.extend(_line_starts(tokens, max(start, len(tokens) - BRANCH_REACH), decode))
    preferred.append(instructions_end)
    preferred.extend(reversed(message_ends))
    preferred.append(len(tokens) - BRANCH_REACH)
    inside = (p for p in preferred if start < p < target or p == target == end_of_prompt > start)
    kept = set(list(dict.fromkeys(inside))[: rule.most])
    if rule.spacing > 0:
        kept |= _periodic(start, target, rule.spacing, kept, rule.most - len(kept))
    # Never inside an image's soft tokens: the pass cut there would split the run, which a family
    # attending both ways inside it must see whole (runtime/backends/vision/bidirectional.py).
    return sorted(p for p in kept if not inside_span(tokens, p))


def _periodic(start: int, target: int, spacing: int, kept: set[int], room: int) -> set[int]:
    """Multiples of ``spacing`` in (start, target), none within ``spacing / PERIODIC_GAP_SHARE``
    of ``start``, ``target`` or a point in ``kept``; at most ``room`` of them: all, or every
    multiple of the narrowest wider power-of-two spacing that fits, and then as many of the others
    as room is left for, latest first (an edit near the end is the likelier)."""
    first = (start // spacing + 1) * spacing
    gap = max(1, spacing // PERIODIC_GAP_SHARE)  # at least: not a point kept already
    ends = {start, target, *kept}
    periodic = [p for p in range(first, target, spacing) if all(abs(p - q) >= gap for q in ends)]
    if len(periodic) <= room:
        return set(periodic)
    wide = spacing * 2  # twice as wide: its points are still multiples of the denser spacing
    while sum(1 for p in periodic if p % wide == 0) > room:
        wide *= 2
    chosen = {p for p in periodic if p % wide == 0}
    rest = [p for p in reversed(periodic) if p not in chosen]
    return chosen | set(rest[: room - len(chosen)])


def _line_starts(
    tokens: Sequence[int], floor: int, decode: Callable[[Sequence[int]], str]
) -> list[int]:
    """The latest ``LINE_STARTS`` token counts above ``floor`` and below the end whose last token
    holds a newline (the state just before the next line began), latest first."""
    found: list[int] = []
    for index in range(len(tokens) - 2, floor - 1, -1):  # a start at the end is point 1
        if "\n" in decode([tokens[index]]):
            found.append(index + 1)
            if len(found) == LINE_STARTS:
                break
    return found
