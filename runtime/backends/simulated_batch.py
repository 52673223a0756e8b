"""The simulated backend's decode batch: rows that step together, as mlx-lm's batch KV does.

One step costs one decode step however many rows it has, and its padding is what mlx-lm's
left-padded batch KV would hold, so the engine's batching and its padding's bytes are exercised on
the simulator as on MLX. A fault in a step leaves every row as it was (no row advances alone).
See docs/design.md, "Fast path and continuous batching".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Protocol

from runtime.backends.contract import SequenceState
from runtime.backends.options import SimulatedModelOptions
from runtime.backends.simulated_tokens import (
    ComputeClock,
    SimulatedFault,
    SimulatedState,
    extend_hash,
    own_state,
    read_token,
)

if TYPE_CHECKING:
    import mlx.core as mx


class _Model(Protocol):
    """What a batch uses of its ``SimulatedBackend`` (typed here, so neither imports the other)."""

    @property
    def _options(self) -> SimulatedModelOptions: ...

    @property
    def _clock(self) -> ComputeClock: ...

    def _check_probed(self) -> None: ...

    def logits_after(self, h: int) -> mx.array: ...


class SimulatedBatch:
    """A decode batch of simulated states: one step costs one decode step, however many rows."""

    def __init__(self, backend: _Model) -> None:
        self._backend = backend
        self._rows: dict[int, SimulatedState] = {}
        self._next_slot = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def padding_tokens(self) -> int:
        """Left padding mlx-lm's batch KV would hold for these rows: B * longest - sum of lengths
        (rows are right-aligned; a leave drops the padding every row shares)."""
        lengths = [row.length for row in self._rows.values()]
        return len(lengths) * max(lengths) - sum(lengths) if lengths else 0

    def join(self, state: SequenceState) -> int:
        own = own_state(state)
        if self._backend._options.fail_join:
            raise SimulatedFault("injected fault: this model's states cannot join a batch")
        self._next_slot += 1
        self._rows[self._next_slot] = SimulatedState(list(own.tokens), list(own.hashes))
        return self._next_slot

    def leave(self, slot: int) -> SimulatedState:
        return self._rows.pop(slot)

    def step(
        self, tokens: Mapping[int, int | mx.array], argmax: Collection[int] = ()
    ) -> dict[int, mx.array]:  # logits for ``argmax`` slots too (the contract allows either)
        if set(tokens) != set(self._rows):
            raise ValueError("a batch step needs exactly one token for every member")
        self._backend._check_probed()
        self._backend._clock.spend(self._backend._options.decode_s_per_token)
        ids = {slot: read_token(t) for slot, t in tokens.items()}
        hashes = {
            slot: extend_hash(self._rows[slot].hashes[-1] if self._rows[slot].hashes else 0, t)
            for slot, t in ids.items()
        }
        # One forward pass: a fault leaves every row as it was (no row advances alone).
        logits = {slot: self._backend.logits_after(h) for slot, h in hashes.items()}
        for slot, token in ids.items():
            self._rows[slot].tokens.append(token)
            self._rows[slot].hashes.append(hashes[slot])
        return logits
