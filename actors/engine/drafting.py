"""Prompt-lookup drafts and how many to verify: the speculative side of a decoding sequence.

A draft is the run of tokens that followed the most recent earlier occurrence of the history's last
few tokens (an editor's code, a quoted document), so no second model is needed. Verifying k drafts
costs one pass over k + 1 tokens (``pass_cost``: concave on a CPU), so ``Speculation.size`` picks
k for the most tokens per second at the acceptance rate seen so far, raised inside a copy that has
held: where drafts keep failing it falls to 0 (plain pipelined decoding) while its estimate drifts
back, so a later quote is noticed. With a draft model (draft_model.py) its tokens are the drafts.

See docs/design.md, "Speculative decoding (prompt lookup)".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import takewhile
from typing import TYPE_CHECKING

from runtime.backends.vision.media import is_media

if TYPE_CHECKING:
    from actors.engine.draft_model import DraftSource

NGRAMS = (3, 2)  # the longest suffix that matches wins; one token alone matches too often
# A 2-gram match drafts only while drafts are being accepted (inside a copy): in free text two
# tokens recur often ("of the") and what followed them is rarely what follows now.
_SHORT_MATCH_RATE = 0.8
# A pass of n tokens costs about 1 + PASS_LOG * log2(n) one-token passes up to TAIL_FROM tokens,
# then TAIL_SLOPE more a token: on a CPU a wider pass reuses each weight it reads, so the cost is
# concave until the pass is compute-bound (a linear 1 + 0.2 (n - 1), used before, priced an
# 8-token pass at 2.4 and kept passes to 2-3 drafts inside long copies). Measured with OpenBLAS on
# 2 threads after a 300-token prompt (scripts/speculative_pass_cost.py, medians of 7), n = 2 / 3 /
# 4 / 6 / 8: SmolLM2 1.20 / 1.39 / 1.52 / 1.64 / 1.79x, Gemma 3 270M 1.22 / 1.45 / 1.67 / 1.73 /
# 1.79x (least squares: 0.25 and 0.28 x log2(n)); SmolLM2 again for n = 9..12 on a busier
# machine, 1.85 / 1.95 / 2.06 / 2.11x (0.09 a token past 8; the log alone said 1.93x at 12). A
# GPU pass is nearly flat. Constants, not timed at run time: what a seeded request samples must
# not depend on how busy the machine was.
PASS_LOG = 0.27
TAIL_FROM = 8
TAIL_SLOPE = 0.09
PRIOR = 0.6  # the acceptance rate assumed before any pass, and drifted back to meanwhile
_WEIGHT = 0.3  # of a pass's own rate in the running estimate
_DRIFT = 0.003  # per token decoded plainly, back towards PRIOR: a retry ~20 tokens after a miss
_GAIN = 1.1  # a pass must promise this many times a plain step's tokens per second
# Inside a copy that has held for r tokens the next draft holds more often than the running rate
# says (copies are long or short, not breaking at a steady rate): the chance is the running rate
# weighted as RUN_PRIOR tokens of evidence, plus r held and none broken.
RUN_PRIOR = 4.0


def pass_cost(tokens: int) -> float:
    """What a pass over ``tokens`` tokens costs, in one-token passes."""
    head = min(tokens, TAIL_FROM)
    return 1.0 + PASS_LOG * math.log2(head) + TAIL_SLOPE * (tokens - head)


class PromptLookup:
    """The n-gram index of a growing history (each n-gram's latest end position before the last
    token), and the copy that its drafts come from.

    While the history goes on as the copy's source did, the next drafts continue the source, not
    the latest match of the last n-gram (another copy of the same words, e.g. a name that recurs).
    Where the history breaks from its source (a renamed identifier in a rewrite), the break's
    first token is taken for a substitution: one draft guesses that the source goes on right after
    the token it replaced. A guess that holds is the copy again (its run goes on); one that fails
    costs one drafted token and leaves the acceptance estimate alone (``guessed``), so the next
    n-gram match resumes the copy as before. Rejected drafts never enter the history: it only
    grows. ``run``: how many tokens the copy has held since its match (0: no copy).
    """

    def __init__(self) -> None:
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        self._indexed = 0  # n-grams ending before this position are indexed
        self._source: int | None = None  # the copy: history[_at] should be history[_source]
        self._at = 0
        self._guessing = False  # the copy is a guess no token has confirmed yet
        self._broke: tuple[int, int, int] | None = None  # (source, history, run) at a break
        self.run = 0
        self.guessed = False  # the last drafts were a guess

    def catch_up(self, history: Sequence[int]) -> None:
        """Index the history's new n-grams and follow the copy over its new tokens."""
        last = len(history) - 1
        for end in range(self._indexed, last):
            for n, index in self._index.items():
                if end + 1 >= n:
                    index[tuple(history[end + 1 - n : end + 1])] = end
        self._indexed = max(self._indexed, last)
        while self._source is not None and self._at < len(history):
            if history[self._at] != history[self._source]:
                # A failed guess is no new break: it gets no guess of its own.
                self._broke = None if self._guessing else (self._source, self._at, self.run)
                self._source, self.run = None, 0
                return
            self._source += 1
            self._at += 1
            self._guessing = False
            self.run += 1

    def draft(self, history: Sequence[int], limit: int, shortest: int = 2) -> list[int]:
        """Up to ``limit`` tokens: the copy's next; else what followed the latest earlier match
        of the history's end (``shortest`` tokens or more); else a guess after a break."""
        self.guessed = False
        if limit <= 0 or len(history) < 2:
            return []
        self.catch_up(history)
        if self._source is None:
            for n, index in self._index.items():
                if shortest <= n <= len(history):
                    found = index.get(tuple(history[len(history) - n :]))
                    if found is not None:
                        self._copy(history, found + 1, guessing=False, run=0)
                        break
            else:
                self._guess(history)
        if self._source is None:
            return []
        self.guessed = self._guessing
        return _follow(history, self._source, 1 if self._guessing else limit)

    def _guess(self, history: Sequence[int]) -> None:
        """After a break, once: the source goes on as many tokens past the break as the history
        has since (a substitution of equal length; one token right after a rejected draft)."""
        if self._broke is None:
            return
        source, broke_at, run = self._broke
        self._broke = None
        resumed = source + len(history) - broke_at
        if resumed < broke_at:
            self._copy(history, resumed, guessing=True, run=run)

    def _copy(self, history: Sequence[int], start: int, *, guessing: bool, run: int) -> None:
        self._source, self._at, self._guessing, self._broke = start, len(history), guessing, None
        self.run = run


def _follow(history: Sequence[int], start: int, limit: int) -> list[int]:
    """``limit`` tokens from ``start`` on; past the history's end the drafts go on from their own
    start (a match ``p`` tokens back is a loop of period ``p``: it repeats)."""
    drafts = list(history[start : start + limit])
    period = len(history) - start
    while len(drafts) < limit:
        drafts.append(drafts[len(drafts) - period])
    # An image's soft tokens (media ids) are never sampled: a draft of one is always rejected.
    return list(takewhile(lambda t: not is_media(t), drafts))


class Speculation:
    """One sequence's drafting: its lookup, its acceptance estimate, and what it has done.

    ``most`` is the request's limit on drafts per pass; ``source``, a draft model's state, drafts
    instead of the lookup. Not thread-safe: decode steps only.
    """

    def __init__(self, most: int, source: DraftSource | None = None) -> None:
        self.most = most
        self.source = source
        self.lookup = PromptLookup()
        self.rate = PRIOR  # estimated chance that each next draft is accepted
        self.drafted = 0
        self.accepted = 0
        self.passes = 0
        self.replays = 0  # passes whose rejected tail could not be cut back (recurrent layers)
        self._guessed = False  # the pending pass verifies a guess (see PromptLookup)
        per_draft = 0.0 if source is None else source.cost  # a draft model's pass per draft
        # What a pass of k drafts costs, k = 0..most: a constant table, not recomputed a step.
        self._cost = [pass_cost(k + 1) + per_draft * k for k in range(most + 1)]

    def size(self, room: int) -> int:
        """How many drafts the next pass should verify (0: decode plainly), at most ``room``."""
        a = min(self.chance(), 0.99)
        best, best_gain, expected, power = 0, _GAIN, 1.0, 1.0
        for k in range(1, min(self.most, room) + 1):
            power *= a
            expected += power  # (1 - a^(k+1)) / (1 - a): the tokens a pass of k drafts yields
            gain = expected / self._cost[k]
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def chance(self) -> float:
        """The chance the next draft holds: the running rate, raised by the copy's run."""
        run = 0 if self.source is not None else self.lookup.run
        return (self.rate * RUN_PRIOR + run) / (RUN_PRIOR + run)

    def drafts(self, history: Sequence[int], room: int) -> list[int]:
        """The drafts for the next pass (none: it decodes plainly)."""
        if self.source is not None:
            n = self.size(room)
            return self.source.drafts(history, n) if n else []
        self.lookup.catch_up(history)  # the copy's run so far, for ``size``
        drafts = self.lookup.draft(history, self.size(room), self._shortest())
        self._guessed = self.lookup.guessed
        return drafts

    def expects_drafts(self, history: Sequence[int], room: int) -> bool:
        """Whether a pass is likely after the next token: the history's end is a copy already
        (asked before that token is read, to leave the step after it unbuilt)."""
        if self.source is not None:  # a draft model drafts anywhere, while it pays
            return self.size(room) > 0
        self.lookup.catch_up(history)
        return bool(self.lookup.draft(history, min(1, self.size(room)), self._shortest()))

    def _shortest(self) -> int:
        return 2 if self.rate >= _SHORT_MATCH_RATE else 3

    def passed(self, drafted: int, accepted: int) -> None:
        """A verification pass accepted ``accepted`` of ``drafted``."""
        self.drafted += drafted
        self.accepted += accepted
        self.passes += 1
        if self._guessed:  # a failed guess says nothing of how well the copies go
            self._guessed = False
            return
        if self.source is not None:
            self.source.settle(accepted)
        # A pass stops at the first rejection: accepted of (accepted + 1) trials, unless all were.
        trials = accepted + (accepted < drafted)
        if trials:
            self.rate += _WEIGHT * (accepted / trials - self.rate)

    def decoded_plainly(self) -> None:
        """A token came from a plain step: the estimate drifts back towards the prior."""
        self.rate += _DRIFT * (PRIOR - self.rate)
