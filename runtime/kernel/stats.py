"""Counters an actor keeps, and the immutable snapshot it hands out."""

from __future__ import annotations

from collections import Counter


class Counters:
    """Monotonic event counts (a counter may be adjusted down only to correct itself)."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def inc(self, name: str, amount: int = 1) -> None:
        self._counts[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        """A copy, so a reader never sees later changes."""
        return dict(self._counts)
