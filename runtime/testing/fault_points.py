"""Fault points: where a wrapped backend, decode batch or KV keeper stops to ask about a fault.

``FaultyBackend`` calls ``at(point)`` before a prefill chunk (``PREFILL``: a call with the
sequence's abort flag, as the engine's chunks pass it, or newcomers' prompts prefilled together
with ``prefill_together``), a B=1 decode step (``DECODE``: ``logits`` or ``feed``), a prefill that
takes checkpoint snapshots or ``snapshot`` (``SNAPSHOT``), a piece of a deferred load probe
(``PROBE``), a piece of idle housekeeping (``TIDY``); its decode batches before each forward pass
(``BATCH_STEP``). ``FaultyKeeper`` asks before granting a sequence's reservation (``RESERVE``);
``LOAD`` is asked by the plan's loader. What happens there is the plan's
(runtime/testing/faults.py); these wrappers only know where.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from runtime.backends.contract import (
    Backend,
    DecodeBatchHandle,
    DeferredProbe,
    ModelInfo,
    SequenceState,
    Snapshot,
)
from runtime.errors import KVBudgetExhausted
from runtime.kernel.core import ActorCore, Address, Context
from runtime.messages import HolderKind, Message, ReservationRefused, Reserve
from runtime.text.chat import ChatTokenizer

if TYPE_CHECKING:
    import mlx.core as mx


class FaultPoint(enum.StrEnum):
    """Where a fault can be injected (module docstring)."""

    LOAD = "load"
    PREFILL = "prefill"
    DECODE = "decode"
    BATCH_STEP = "batch_step"
    SNAPSHOT = "snapshot"
    PROBE = "probe"
    TIDY = "tidy"
    RESERVE = "reserve"


class FaultyBackend:
    """A ``Backend`` that calls ``at(point)`` before the calls each point names (``at`` raises,
    spends time or hangs, as a fault plan says); everything else passes through."""

    def __init__(self, inner: Backend, at: Callable[[FaultPoint], None]) -> None:
        self._inner = inner
        self._at = at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)  # what a test reads of the simulated backend

    @property
    def inner(self) -> Backend:
        return self._inner

    @property
    def info(self) -> ModelInfo:
        return self._inner.info

    @property
    def chat_tokenizer(self) -> ChatTokenizer:
        return self._inner.chat_tokenizer

    @property
    def pipelined(self) -> bool:
        return self._inner.pipelined

    @property
    def queues_steps(self) -> bool:
        return self._inner.queues_steps

    @property
    def decode_block(self) -> int:
        return self._inner.decode_block

    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._inner.decode(token_ids)

    def new_state(self) -> SequenceState:
        return self._inner.new_state()

    def can_trim(self, state: SequenceState) -> bool:
        return self._inner.can_trim(state)

    def copy_state(
        self,
        state: SequenceState,
        length: int,
        snapshot: Snapshot | None = None,
        *,
        reach: int = 0,
    ) -> SequenceState:
        return self._inner.copy_state(state, length, snapshot, reach=reach)

    def take_state(
        self,
        state: SequenceState,
        length: int,
        snapshot: Snapshot | None = None,
        *,
        reach: int = 0,
    ) -> SequenceState:
        return self._inner.take_state(state, length, snapshot, reach=reach)

    def state_nbytes(self, state: SequenceState) -> int:
        return self._inner.state_nbytes(state)

    def close(self) -> None:
        self._inner.close()

    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        *,
        logits: bool = True,
        snapshot_at: Sequence[int] = (),
        stop: threading.Event | None = None,
    ) -> Sequence[Snapshot]:
        if stop is not None:  # a prefill chunk (a decode step feeds its token without a flag)
            self._at(FaultPoint.PREFILL)
        if snapshot_at:
            self._at(FaultPoint.SNAPSHOT)
        return self._inner.prefill(
            state, token_ids, logits=logits, snapshot_at=snapshot_at, stop=stop
        )

    def prefill_together(
        self,
        states: Sequence[SequenceState],
        token_ids: Sequence[Sequence[int]],
        snapshot_at: Sequence[Sequence[int]] = (),
    ) -> Sequence[Sequence[Snapshot]]:
        # Newcomers' whole prompts prefilled in one pass: a prefill, as each chunk is.
        self._at(FaultPoint.PREFILL)
        if any(snapshot_at):
            self._at(FaultPoint.SNAPSHOT)
        return self._inner.prefill_together(states, token_ids, snapshot_at)

    def snapshot(self, state: SequenceState) -> Snapshot:
        self._at(FaultPoint.SNAPSHOT)
        return self._inner.snapshot(state)

    def logits(self, state: SequenceState) -> mx.array:
        self._at(FaultPoint.DECODE)
        return self._inner.logits(state)

    def feed(self, state: SequenceState, token: mx.array) -> mx.array:
        self._at(FaultPoint.DECODE)
        return self._inner.feed(state, token)

    def open_batch(self) -> DecodeBatchHandle | None:
        batch = self._inner.open_batch()
        return None if batch is None else FaultyBatch(batch, self._at)

    def deferred_probe(self) -> DeferredProbe | None:
        probe = self._inner.deferred_probe()
        return None if probe is None else FaultyProbe(probe, self._at)

    def tidy(self) -> bool:
        self._at(FaultPoint.TIDY)
        return self._inner.tidy()


class FaultyProbe:
    """A deferred load probe that calls ``at(PROBE)`` before each piece."""

    def __init__(self, inner: DeferredProbe, at: Callable[[FaultPoint], None]) -> None:
        self._inner = inner
        self._at = at

    def step(self) -> ModelInfo | None:
        self._at(FaultPoint.PROBE)
        return self._inner.step()


class FaultyBatch:
    """A ``DecodeBatchHandle`` that calls ``at(BATCH_STEP)`` before each step."""

    def __init__(self, inner: DecodeBatchHandle, at: Callable[[FaultPoint], None]) -> None:
        self._inner = inner
        self._at = at

    @property
    def inner(self) -> DecodeBatchHandle:
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def join(self, state: SequenceState) -> int:
        return self._inner.join(state)

    def leave(self, slot: int) -> SequenceState:
        return self._inner.leave(slot)

    def step(
        self, tokens: Mapping[int, int | mx.array], argmax: Collection[int] = ()
    ) -> Mapping[int, mx.array | int]:
        self._at(FaultPoint.BATCH_STEP)
        return self._inner.step(tokens, argmax)


class FaultyKeeper:
    """The KV keeper's core, refusing a sequence's ``Reserve`` when ``refuses(model)`` says so
    (answered as the keeper answers a deadline: retryable ``kv_budget_exhausted``)."""

    def __init__(self, inner: ActorCore, refuses: Callable[[str], bool]) -> None:
        self.inner = inner
        self._refuses = refuses

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # statistics() and the tests' read-only views

    def on_start(self, ctx: Context) -> None:
        self.inner.on_start(ctx)

    def on_stop(self, ctx: Context) -> None:
        self.inner.on_stop(ctx)

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        if (
            isinstance(message, Reserve)
            and message.holder.kind is HolderKind.SEQUENCE
            and self._refuses(message.holder.model)
        ):
            text = "injected refusal: the KV budget is exhausted; retry later"
            refused = ReservationRefused(
                holder=message.holder,
                nbytes=message.nbytes,
                code=KVBudgetExhausted.code,
                message=text,
                retryable=KVBudgetExhausted.retryable,
            )
            ctx.send(sender, refused)
            return
        self.inner.handle(message, sender, ctx)


def without_faults(wrapped: object) -> object:
    """What a fault wrapper wraps (a ``FaultyBackend``, ``FaultyBatch`` or ``FaultyKeeper``), so a
    test's checks read the simulated object itself; anything else as it is."""
    if isinstance(wrapped, FaultyBackend | FaultyBatch | FaultyKeeper):
        return wrapped.inner
    return wrapped
