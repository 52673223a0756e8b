"""Where to snapshot a sequence whose cache cannot be trimmed (sliding-window or recurrent layers).

Such a cache can only be reused whole, so the engine snapshots it at the token counts a later
prompt is most likely to share with this one:

- the end of the prompt minus one token (the same prompt again: one token left to run);
- the last word boundary before the end (a person typing re-tokenizes the last word, so the next
  prompt rarely extends this one's tokens exactly);
- every ``every`` tokens of a long prefill (an edit in the middle of a long document reuses all
  before it);
- the end of the instructions (system/developer messages) when a chat prompt says where it is, so
  another conversation with the same instructions reuses them.

The end of a generation and the point where an aborted prefill stopped are snapshotted by the
engine itself, as the sequence's own final state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

WORD_SCAN_TOKENS = 32  # how far back to look for the last word boundary


def plan_checkpoints(
    tokens: Sequence[int],
    start: int,
    target: int,
    every: int,
    decode: Callable[[Sequence[int]], str],
    instructions_end: int = 0,
) -> list[int]:
    """Sorted token counts strictly between ``start`` (cached) and ``target`` to snapshot at."""
    points: set[int] = set()
    end_of_prompt = len(tokens) - 1
    points.add(end_of_prompt)
    for index in range(end_of_prompt, max(start, end_of_prompt - WORD_SCAN_TOKENS), -1):
        if decode([tokens[index]])[:1].isspace():
            points.add(index)  # the state just before the last word began
            break
    if every > 0:
        points.update(range(every, target, every))
    if instructions_end > 0:
        points.add(instructions_end)
    return sorted(p for p in points if start < p < target)
