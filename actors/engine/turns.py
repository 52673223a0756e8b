"""Whether a newcomer's prompt goes ahead of the decoding streams, or waits its turn.

A decode step reads every weight once whatever its batch size, so where reading weights is the cost
a step of 8 rows takes little more than a step of 1: decoding the first of several requests that
arrived together while the others wait to prefill wastes steps. So a generate whose prompt finishes
in its next job goes ahead of the decode work if it can join the batch (as ``mlx_lm.server`` does).
The streams wait at most ``stall_s`` (``EngineOptions.decode_stall_ms``); a longer prompt never
jumps, its chunks take turns with the decode steps.

See docs/design.md, "Fast path and continuous batching".
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Ordered

from actors.engine.sequence import Phase, Sequence
from runtime.messages import RequestKind


class PromptTurns:
    """When decode work last had to wait for a newcomer, and who may go ahead of it now."""

    def __init__(self, stall_s: float, max_batch: int, batching: bool) -> None:
        # Without a batch a newcomer never shares a step, so going first only delays the others.
        self._stall_s = stall_s if batching else 0.0
        self._max_batch = max_batch
        self._waiting_since: float | None = None  # decode work first waited for a newcomer

    def decode_owed(self, now: float) -> bool:
        """Decode work waited its limit behind newcomers: it goes next, before any other turn."""
        return self._waiting_since is not None and now - self._waiting_since >= self._stall_s

    def ahead_of_decoding(
        self,
        ready: Ordered[Sequence],
        everyone: Iterable[Sequence],
        chunk_tokens: int,
        now: float,
    ) -> Sequence | None:
        """The newcomer in ``ready`` (in its order) that runs before the waiting decode work now,
        or None. ``everyone``: the engine's sequences (who decodes); ``chunk_tokens``: the size of
        the next prefill chunk."""
        if self._stall_s <= 0 or self.decode_owed(now):
            return None
        if rows_taken(everyone) >= self._max_batch:  # it could not join: it would only delay
            return None
        # A first draw first: it ends a time to first token, and takes a moment.
        newcomers = sorted(
            (s for s in ready if _finishes_prompt(s, chunk_tokens)),
            key=lambda s: s.phase is not Phase.DECODING,
        )
        newcomer = newcomers[0] if newcomers else None
        if newcomer is not None and self._waiting_since is None:
            self._waiting_since = now
        return newcomer

    def decode_ran(self) -> None:
        """Decode work was handed to the executor, or none is waiting: no pause to bound."""
        self._waiting_since = None


def rows_taken(everyone: Iterable[Sequence]) -> int:
    """Decode-batch rows that sequences showing tokens hold or will (a sequence yet to draw its
    first token is a newcomer: it takes a row once it joins)."""
    return sum(
        1
        for s in everyone
        if s.phase is Phase.DECODING and s.decoding is not None and s.decoding.read > 0
    )


def _finishes_prompt(seq: Sequence, chunk_tokens: int) -> bool:
    """A generate whose next job is its restore, the last chunk of its prompt, or its first draw
    (the first token: its time to first token ends there)."""
    if seq.kind is not RequestKind.GENERATE:
        return False  # a prewarm never joins a batch: it waits its turn
    if seq.phase is Phase.RESTORING:
        return True  # a copy, or an empty state: short, and the prefill comes next
    if seq.phase is Phase.DECODING:
        return seq.awaits_first_draw
    if seq.phase is not Phase.PREFILLING or seq.state is None:
        return False
    return seq.prefill_rest <= chunk_tokens
