"""How many prompt tokens an engine's next prefill chunk takes: as many as fit its time budget.

A chunk is what a decode-batch step or another sequence's work waits behind, so it aims to take
``budget_s`` (``EngineOptions.prefill_chunk_ms``). A chunk of n tokens takes about a + b·n (a: a
one-token pass, ``ModelInfo.pass_s``; b: learned). A chunk takes at least two passes per stop check
(an abort waits for one), between ``MIN_PASSES`` and ``MAX_PASSES``; a lone prefill takes the cap. A
chunk is never more than ``cap`` (``ModelSpec.prefill_chunk_tokens``) nor fewer than
``MIN_CHUNK_TOKENS``, and is the cap until one is measured or when the budget is 0.

The rule and its figures: docs/design.md, "One step" ("Chunks are sized by time").
"""

from __future__ import annotations

MIN_CHUNK_TOKENS = 32
# A chunk's floor in passes (two per stop check, clamped). Measured on a loaded 2-core CPU: the
# 4-layer tiny llama's short request after an abandoned prefill took 3.3x its idle TTFT at 16
# passes and 1.5x at 8; Gemma 3 270M's 500-token cold TTFT was 5-15% longer at 8 passes than in two
# chunks of 256. A recent chunk weighs most (DECAY): a short one, mostly fixed cost, would otherwise
# make the rate look slow and the next chunks too small.
MIN_PASSES = 8
MAX_PASSES = 16
DECAY = 0.5  # the weight an earlier measurement keeps at each new one
# A lone prefill (no decode work behind it) takes the cap, whose checks stay this far apart at
# most. Measured with llama.cpp, whose passes a 10 ms budget cut to ~50 tokens: a 1,400-token cold
# prompt took 1.34x (SmolLM2) and 1.16x (Gemma 3) llama-server's TTFT in those chunks, 1.00x and
# 0.96x in chunks of its cap (512, flash attention on; 1.07x both in chunks of 256).
LONE_CHECK_GAP_S = 0.05  # a lone prefill's chunk may make an abort wait this long at most


class ChunkSizer:
    """The next chunk's token count, from the chunks measured so far (module docstring)."""

    def __init__(self, cap: int, budget_s: float) -> None:
        self._cap = max(1, cap)
        self._budget_s = budget_s
        self._floor = min(MIN_CHUNK_TOKENS, self._cap)
        self._pass_s = 0.0
        self._passes = MAX_PASSES  # a chunk's least time, in passes
        self._stop_checks = 1
        self._seconds = 0.0  # decayed sums of the chunks measured (their time less a pass's)
        self._tokens = 0.0

    def loaded(self, pass_s: float, stop_checks: int) -> None:
        """The model is in: a pass's fixed cost and its stop checks (``ModelInfo``'s)."""
        self._pass_s = pass_s
        self._stop_checks = max(1, stop_checks)
        if stop_checks > 0:
            self._passes = max(MIN_PASSES, min(MAX_PASSES, 2 * stop_checks))

    def observe(self, tokens: int, seconds: float) -> None:
        """A chunk of ``tokens`` took ``seconds`` (from its submission to its result)."""
        if tokens > 0 and seconds > self._pass_s:  # a faster one says nothing about the rate
            self._seconds = self._seconds * DECAY + seconds - self._pass_s
            self._tokens = self._tokens * DECAY + tokens

    def tokens(self, lone: bool = False) -> int:
        """How many tokens the next chunk takes; ``lone``: no decode work waits behind it."""
        if self._budget_s <= 0 or self._seconds <= 0:
            return self._cap
        if lone:
            at_cap_s = self._pass_s + self._cap * self._seconds / self._tokens
            if at_cap_s / self._stop_checks <= LONE_CHECK_GAP_S:
                return self._cap
        target_s = max(self._budget_s, self._passes * self._pass_s)
        fit = int((target_s - self._pass_s) * self._tokens / self._seconds)
        return max(self._floor, min(self._cap, fit))
