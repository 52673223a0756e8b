"""Small helpers the project's tests share (and hosts' tests may use)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two token sequences share: what a trimmable cache can reuse."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
