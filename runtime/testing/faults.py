"""Fault injection: a plan of faults that a wrapped backend and KV keeper consult at named points.

A ``FaultPlan`` holds scripted faults (``Fault``: at which point, of which kind, after how many
clean calls, how many times) and, optionally, random ones drawn from its own seeded source, so a
run with faults is repeated exactly from its seed (on the simulator, where compute order is the
seed's). It can be switched off and on while the runtime runs (``enable``/``disable``), which is
what a state machine with a safety phase (faults on) and a liveness phase (faults off) needs.

The plan reaches the runtime by wrapping: ``wrap_loader`` wraps any ``BackendLoader`` (simulated or
MLX), so every backend it loads consults the plan at each point; ``wrap_keeper`` wraps the KV
keeper's core, which then refuses reservations where the plan says. ``Simulator(faults=plan)`` does
both; a ``Runtime`` takes ``load_backend=plan.wrap_loader(make_backend_loader())``.

Points and what a fault there does (``FaultKind``):

- ``LOAD``: loading the model. ``RAISE`` fails the load; ``SLOW`` delays it. (Loads are not
  watched, so a load cannot ``HANG``.)
- ``PREFILL``: a prefill chunk (a call with the sequence's abort flag, as the engine's chunks
  pass it). ``DECODE``: a B=1 decode step (``logits`` or ``feed``). ``BATCH_STEP``: one forward
  pass of the decode batch. ``SNAPSHOT``: a prefill that takes checkpoint snapshots, or
  ``snapshot``. At these ``RAISE`` raises ``InjectedFault`` before the backend is touched,
  ``SLOW`` spends ``seconds`` on the compute clock first, ``HANG`` never returns (on the simulator
  the job's ``ComputeDone`` never arrives; on a real thread it blocks until ``release_hangs``, then
  raises, long after the engine gave up on it).
- ``RESERVE``: a sequence's KV reservation. ``RAISE`` makes the keeper refuse it
  (``kv_budget_exhausted``, retryable) without looking at the budget.
"""

from __future__ import annotations

import enum
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.backends.contract import (
    Backend,
    BackendLoader,
    DecodeBatchHandle,
    ModelInfo,
    SequenceState,
    Snapshot,
)
from runtime.backends.options import ModelOptions
from runtime.backends.simulated import ComputeClock, RealClock
from runtime.errors import KVBudgetExhausted
from runtime.kernel.core import ActorCore, Address, Context
from runtime.messages import (
    HolderKind,
    Message,
    ModelSpec,
    ReservationRefused,
    Reserve,
)
from runtime.text.chat import ChatTokenizer

if TYPE_CHECKING:
    import mlx.core as mx


class FaultPoint(enum.StrEnum):
    LOAD = "load"
    PREFILL = "prefill"
    DECODE = "decode"
    BATCH_STEP = "batch_step"
    SNAPSHOT = "snapshot"
    RESERVE = "reserve"


class FaultKind(enum.StrEnum):
    RAISE = "raise"
    SLOW = "slow"
    HANG = "hang"


# What each point can do: a load is not watched (it would never end), a reservation only refuses.
KINDS_AT: Mapping[FaultPoint, frozenset[FaultKind]] = {
    FaultPoint.LOAD: frozenset({FaultKind.RAISE, FaultKind.SLOW}),
    FaultPoint.RESERVE: frozenset({FaultKind.RAISE}),
    **{
        point: frozenset(FaultKind)
        for point in (
            FaultPoint.PREFILL,
            FaultPoint.DECODE,
            FaultPoint.BATCH_STEP,
            FaultPoint.SNAPSHOT,
        )
    },
}


class InjectedFault(RuntimeError):
    """Raised by a wrapped backend where the plan injects a fault (``RAISE``, or a released
    ``HANG``)."""


@dataclass(frozen=True)
class Fault:
    """Inject ``kind`` at ``point`` (of ``model``, or any model): the calls there after the first
    ``after`` clean ones, ``times`` of them (0: every one from then on). ``seconds``: how long a
    ``SLOW`` fault takes. Raises ``ValueError`` for a kind the point cannot do."""

    point: FaultPoint
    kind: FaultKind = FaultKind.RAISE
    model: str | None = None
    after: int = 0
    times: int = 1
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS_AT[self.point]:
            allowed = ", ".join(sorted(KINDS_AT[self.point]))
            raise ValueError(f"a {self.point} fault can only be: {allowed} (got {self.kind})")
        if self.after < 0 or self.times < 0 or self.seconds < 0:
            raise ValueError("after, times and seconds must not be negative")


@dataclass(frozen=True)
class Injection:
    """One fault as it was injected: where, of which model, and what."""

    point: FaultPoint
    model: str
    kind: FaultKind


class _Armed:
    """A scripted fault and how many matching calls it has seen."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.seen = 0

    def fires(self, point: FaultPoint, model: str) -> bool:
        fault = self.fault
        if fault.point is not point or fault.model not in (None, model):
            return False
        self.seen += 1
        past = self.seen - fault.after
        return past > 0 and (fault.times == 0 or past <= fault.times)


class FaultPlan:
    """Scripted and random faults, switchable at run time (see module docstring). Thread-safe:
    compute threads consult it.

    ``rate``: the chance that a call at one of ``points`` gets a random fault of one of ``kinds``
    (those the point can do), drawn from ``random.Random(seed)``; ``slow_s`` is a random
    ``SLOW`` fault's length.
    """

    def __init__(
        self,
        *faults: Fault,
        seed: int = 0,
        rate: float = 0.0,
        points: Sequence[FaultPoint] = tuple(FaultPoint),
        kinds: Sequence[FaultKind] = (FaultKind.RAISE,),
        slow_s: float = 1.0,
    ) -> None:
        self._lock = threading.Lock()
        self._armed = [_Armed(fault) for fault in faults]
        self._rng = random.Random(seed)
        self._rate = rate
        self._points = frozenset(points)
        self._kinds = tuple(kinds)
        self._slow_s = slow_s
        self._enabled = True
        self._released = threading.Event()
        self.injected: list[Injection] = []

    # ------------------------------------------------------------------ switching

    @property
    def enabled(self) -> bool:
        return self._enabled

    def enable(self) -> None:
        self._enabled = True

    def disable(self) -> None:
        """No fault from now on (a job already hanging stays hung until ``release_hangs``)."""
        self._enabled = False

    def arm(self, fault: Fault) -> None:
        """Add a scripted fault; its counting starts now."""
        with self._lock:
            self._armed.append(_Armed(fault))

    def release_hangs(self) -> None:
        """Let every thread blocked in a ``HANG`` go (it raises ``InjectedFault``); later hangs
        on real threads return at once. Call it before the process exits."""
        self._released.set()

    # ------------------------------------------------------------------ consulting

    def check(self, point: FaultPoint, model: str) -> Fault | None:
        """The fault to inject at this call of ``point`` for ``model``, if any (and record it)."""
        with self._lock:
            if not self._enabled:
                return None
            # Every armed fault counts the call (its ``after`` counts calls since it was armed).
            firing = [a.fault for a in self._armed if a.fires(point, model)]
            fault = firing[0] if firing else None
            if fault is None:
                fault = self._random_fault(point)
            if fault is not None:
                self.injected.append(Injection(point, model, fault.kind))
            return fault

    def _random_fault(self, point: FaultPoint) -> Fault | None:
        if point not in self._points or self._rng.random() >= self._rate:
            return None
        kinds = [k for k in self._kinds if k in KINDS_AT[point]]
        if not kinds:
            return None
        kind = self._rng.choice(kinds)
        return Fault(point, kind, seconds=self._slow_s if kind is FaultKind.SLOW else 0.0)

    def apply(
        self, point: FaultPoint, model: str, clock: ComputeClock, hang: Callable[[], None] | None
    ) -> None:
        """Consult the plan at ``point`` and act: raise, spend time, or hang (then raise)."""
        fault = self.check(point, model)
        if fault is None:
            return
        if fault.kind is FaultKind.SLOW:
            clock.spend(fault.seconds)
            return
        if fault.kind is FaultKind.HANG:
            if hang is not None:
                hang()  # the simulator: this job's done never arrives
            else:
                self._released.wait()
            raise InjectedFault(f"injected hang at {point} of model {model!r} (released)")
        raise InjectedFault(f"injected fault at {point} of model {model!r}")

    # ------------------------------------------------------------------ wrapping

    def wrap_loader(
        self,
        loader: BackendLoader,
        clock: ComputeClock | None = None,
        hang: Callable[[], None] | None = None,
    ) -> BackendLoader:
        """``loader``, consulting this plan at ``LOAD`` and wrapping every backend it loads.

        ``clock`` is where ``SLOW`` faults spend time (real sleeps by default); ``hang`` makes a
        job never return (the simulator's ``VirtualClock.hang``; None: block the thread)."""
        spend = clock or RealClock()

        def load(spec: ModelSpec, options: ModelOptions) -> Backend:
            self.apply(FaultPoint.LOAD, spec.name, spend, hang)
            return FaultyBackend(loader(spec, options), spec.name, self, spend, hang)

        return load

    def wrap_keeper(self, keeper: ActorCore) -> ActorCore:
        """The KV keeper's core, refusing sequences' reservations where the plan says."""
        return FaultyKeeper(keeper, self)


class FaultyBackend:
    """A ``Backend`` that consults a ``FaultPlan`` before the calls the plan's points name;
    everything else (and anything a test reads of the inner backend) passes through."""

    def __init__(
        self,
        inner: Backend,
        model: str,
        plan: FaultPlan,
        clock: ComputeClock,
        hang: Callable[[], None] | None,
    ) -> None:
        self._inner = inner
        self._model = model
        self._plan = plan
        self._clock = clock
        self._hang = hang

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _at(self, point: FaultPoint) -> None:
        self._plan.apply(point, self._model, self._clock, self._hang)

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

    def encode(self, text: str) -> list[int]:
        return self._inner.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._inner.decode(token_ids)

    def new_state(self) -> SequenceState:
        return self._inner.new_state()

    def can_trim(self, state: SequenceState) -> bool:
        return self._inner.can_trim(state)

    def copy_state(
        self, state: SequenceState, length: int, snapshot: Snapshot | None = None
    ) -> SequenceState:
        return self._inner.copy_state(state, length, snapshot)

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


class FaultyBatch:
    """A ``DecodeBatchHandle`` whose steps consult the plan at ``BATCH_STEP``."""

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

    def step(self, tokens: Mapping[int, int | mx.array]) -> dict[int, mx.array]:
        self._at(FaultPoint.BATCH_STEP)
        return self._inner.step(tokens)


class FaultyKeeper:
    """The KV keeper's core, refusing a sequence's ``Reserve`` where the plan says ``RESERVE``
    (answered as the keeper answers a deadline: retryable ``kv_budget_exhausted``)."""

    def __init__(self, inner: ActorCore, plan: FaultPlan) -> None:
        self.inner = inner
        self._plan = plan

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
            and self._plan.check(FaultPoint.RESERVE, message.holder.model) is not None
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
