"""Batched decoding over mlx-lm's batch caches: the backend half of continuous batching.

A ``DecodeBatch`` holds one persistent batch cache per layer and runs one forward pass per step for
every sequence in it: one weight pass for B tokens instead of B passes. Sequences prefilled on the
B=1 path ``join`` and ``leave`` between steps, leaving the others undisturbed. It is mlx-lm's
``BatchGenerator`` machinery (``merge``, ``extend``, ``extract``, ``filter``) without its prompt
processing or sampling, which the engine owns; cache kinds mlx-lm cannot batch
(``CacheKind.batch_refusal``) stay on the B=1 path.

Layout and the cost of a join, a leave and a step: docs/design.md, "The decode batch".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

import mlx.core as mx

from runtime.backends.contract import SequenceState
from runtime.backends.mlx.cache_kinds import extract_row, kind_of
from runtime.backends.mlx.state import MlxState

__all__ = ["BatchSource", "DecodeBatch"]


class BatchSource(Protocol):
    """What a batch needs of a backend (``MlxBackend`` is one): its model and a fresh state."""

    @property
    def model(self) -> Any: ...

    def new_state(self) -> MlxState: ...


class DecodeBatch:
    """Sequences decoded together, one token each per ``step``, over persistent batch caches.

    Slots are stable integer handles (never reused within one batch); rows in the batch cache are
    renumbered on ``leave`` but slots are not.
    """

    def __init__(self, backend: BatchSource) -> None:
        reason = self.unsupported_reason(backend)
        if reason is not None:
            raise ValueError(f"this model cannot be decoded in a batch: {reason}")
        self._model: Any = backend.model
        self._caches: list[Any] = []  # one batch cache per layer; empty while no row
        self._slots: list[int] = []  # row -> slot
        self._n_tokens: dict[int, int] = {}
        self._logits: dict[int, mx.array | None] = {}
        self._next_slot = 0

    # ------------------------------------------------------------------ capability

    @staticmethod
    def unsupported_reason(backend: BatchSource) -> str | None:
        """Why ``backend``'s caches cannot be batched by mlx-lm, or None when they can."""
        for index, layer_cache in enumerate(backend.new_state().caches):
            reason = kind_of(layer_cache).batch_refusal(layer_cache)
            if reason is not None:
                return f"layer {index}: {reason}"
        return None

    @classmethod
    def supports(cls, backend: BatchSource) -> bool:
        """Whether the engine may batch this model; if not, keep it on the B=1 path."""
        return cls.unsupported_reason(backend) is None

    # ------------------------------------------------------------------ membership

    @property
    def slots(self) -> list[int]:
        """The member slots, in row order."""
        return list(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, slot: object) -> bool:
        return slot in self._n_tokens

    def length(self, slot: int) -> int:
        """Tokens in ``slot``'s cache (prompt plus the tokens stepped so far)."""
        return self._n_tokens[self._check(slot)]

    def logits(self, slot: int) -> mx.array | None:
        """``slot``'s logits after its last token (None if it joined without any)."""
        return self._logits[self._check(slot)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the batch caches, padding and spare capacity included."""
        return sum(int(c.nbytes) for c in self._caches if not c.empty())

    def join(self, state: SequenceState) -> int:
        """Add a prefilled sequence; returns its slot.

        ``state`` is only read: its caches are copied into the batch (``merge`` + ``extend``), so
        the caller may keep it (e.g. in the prefix cache). The sequence's next input token is given
        to ``step``. Cost: about one rewrite of the batch cache (see the module docstring).
        """
        if not isinstance(state, MlxState):
            raise TypeError(f"not an MLX state: {type(state).__name__}")
        # A layer may stay empty in a prefilled state: one the model never writes to (nemotron-nas's
        # linear-replaced attention keeps an empty KVCache); it merges into a batch layer with no
        # keys, which the model never reads either.
        if state.n_tokens <= 0 or all(c.empty() for c in state.caches):
            raise ValueError("join() needs a prefilled state (at least one token)")
        merged = [c.merge([c]) for c in state.caches]
        if not self._slots:
            self._caches = merged
        else:
            if len(merged) != len(self._caches):
                raise ValueError("the state has a different number of layers than the batch")
            for batch_cache, one in zip(self._caches, merged, strict=True):
                batch_cache.extend(one)
        mx.eval([c.state for c in self._caches])
        slot = self._next_slot
        self._next_slot += 1
        self._slots.append(slot)
        self._n_tokens[slot] = state.n_tokens
        self._logits[slot] = state.logits
        return slot

    def leave(self, slot: int) -> MlxState:
        """Remove ``slot``; returns its own per-sequence state (independent of the batch).

        The state holds ordinary B=1 caches (``KVCache``, ``RotatingKVCache``, ``ArraysCache``),
        its token count and its last logits, so it can continue on the B=1 path or be committed to
        the prefix cache. Cost: about one rewrite of the batch cache (see the module docstring).
        """
        row = self._slots.index(self._check(slot))
        caches = [extract_row(c, row) for c in self._caches]
        mx.eval([c.state for c in caches])
        keep = [i for i in range(len(self._slots)) if i != row]
        if keep:
            for batch_cache in self._caches:
                batch_cache.filter(keep)
            mx.eval([c.state for c in self._caches])
        else:
            self._caches = []
        del self._slots[row]
        n_tokens = self._n_tokens.pop(slot)
        logits = self._logits.pop(slot)
        return MlxState(caches, n_tokens, logits)

    # ------------------------------------------------------------------ decoding

    def step(
        self, tokens: Mapping[int, int | mx.array], argmax: Collection[int] = ()
    ) -> dict[int, mx.array]:
        """Feed each member one token in one forward pass; returns each one's (vocab,) logits
        (for ``argmax`` slots too: they are not computed yet, so an argmax here saves nothing).

        ``tokens`` must name every member exactly once: all rows advance together. A token is an
        id or a scalar array not read yet (a draw). Nothing is evaluated here: reading the logits
        (or draws made from them) computes the step, so the next one can be queued first.
        """
        if set(tokens) != set(self._slots):
            missing = sorted(set(self._slots) - set(tokens))
            extra = sorted(set(tokens) - set(self._slots))
            raise ValueError(
                f"step() needs one token per member (missing {missing}, not members {extra})"
            )
        if not self._slots:
            return {}
        fed = [tokens[slot] for slot in self._slots]
        if all(isinstance(t, int) for t in fed):
            inputs = mx.array([[t] for t in fed], dtype=mx.int32)
        else:
            rows = [mx.array([t]) if isinstance(t, int) else t.reshape(1) for t in fed]
            inputs = mx.concatenate([r.astype(mx.int32) for r in rows])[:, None]
        logits = self._model(inputs, cache=self._caches)[:, -1, :].astype(mx.float32)
        out: dict[int, mx.array] = {}
        for row, slot in enumerate(self._slots):
            row_logits = logits[row]
            out[slot] = row_logits
            self._logits[slot] = row_logits
            self._n_tokens[slot] += 1
        return out

    def _check(self, slot: int) -> int:
        if slot not in self._n_tokens:
            raise KeyError(f"slot {slot} is not in this batch")
        return slot
