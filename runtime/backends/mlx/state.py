"""MLX sequence states and snapshots.

Shared by the backend (one sequence at a time) and the decode batch (many), so neither imports the
other. What a layer's cache does (copy, snapshot, cut back) is its kind's (``cache_kinds``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from runtime.backends.contract import SequenceState
from runtime.backends.mlx.cache_kinds import kind_of


class MlxState:
    """A sequence's caches (one per layer), tokens consumed, and the logits after the last one."""

    __slots__ = ("caches", "logits", "n_tokens", "verified")

    def __init__(self, caches: list[Any], n_tokens: int = 0, logits: mx.array | None = None):
        self.caches = caches
        self.n_tokens = n_tokens
        self.logits = logits
        self.verified: Verified | None = None  # the last ``verify``, until its ``rewind``

    @property
    def length(self) -> int:
        return self.n_tokens


class Verified:
    """What ``rewind`` needs of a verification (or drafting) pass: the caches as they were before
    it (shallow copies: the pass writes past their end or makes new arrays), its tokens, and the
    logits after each of them from the ``least``-th on (the fewest tokens a rewind may keep)."""

    __slots__ = ("before", "least", "logits", "start", "token_ids")

    def __init__(
        self,
        before: list[Any],
        start: int,
        token_ids: list[int],
        logits: mx.array,
        least: int = 1,
    ) -> None:
        self.before = before
        self.start = start
        self.token_ids = token_ids
        self.logits = logits
        self.least = least


class MlxSnapshot:
    """What a checkpoint keeps of a state's layers that are not cut back (by layer index, as
    their kinds' ``snapshot`` made them) at ``length`` tokens."""

    __slots__ = ("layers", "n_tokens", "size")

    def __init__(self, layers: dict[int, Any], n_tokens: int) -> None:
        self.layers = layers
        self.n_tokens = n_tokens
        self.size = sum(kind_of(c).nbytes(c) for c in layers.values())

    @property
    def length(self) -> int:
        return self.n_tokens

    @property
    def nbytes(self) -> int:
        return self.size

    def arrays(self) -> list[Any]:
        """What to evaluate so every kept layer is computed."""
        return [a for c in self.layers.values() for a in kind_of(c).arrays(c)]


def own_state(state: SequenceState) -> MlxState:
    if not isinstance(state, MlxState):
        raise TypeError(f"not an MLX state: {type(state).__name__}")
    return state


def check_points(points: Sequence[int], start: int, end: int) -> None:
    """Snapshot points must lie in what a prefill from ``start`` to ``end`` adds."""
    if any(not start < p <= end for p in points):
        raise ValueError(f"snapshot points {list(points)} outside ({start}, {end}]")
