"""Counters an actor keeps, and the immutable snapshot it hands out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class Counters:
    """Monotonic event counts (a counter may be adjusted down only to correct itself).

    ``declared`` names are reported from the start, even while zero, so a reader (a dashboard, a
    test) sees a stable set of keys; any other name appears once it is first counted.
    """

    def __init__(self, declared: Iterable[str] = ()) -> None:
        self._counts: Counter[str] = Counter(dict.fromkeys(declared, 0))

    def inc(self, name: str, amount: int = 1) -> None:
        self._counts[name] += amount

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, int]:
        """A copy (declared names first, in order), so a reader never sees later changes."""
        return dict(self._counts)
