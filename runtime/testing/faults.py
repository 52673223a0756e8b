"""Fault injection: a plan of faults that a wrapped backend and KV keeper consult at named points.

Supervision, the watchdog and the retry paths are only trustworthy if they are exercised, so a
``FaultPlan`` holds scripted faults (``Fault``: point, kind, after how many clean calls, how many
times) and random ones from its own seed, so a faulty run repeats exactly on the simulator. It can
be switched off and on while the runtime runs: a state machine's safety phase runs with faults, its
liveness phase without. It reaches the runtime by wrapping (fault_points.py): ``wrap_loader``,
``wrap_keeper``; ``Simulator(faults=plan)`` does both.

Each point and what each kind does there: docs/design.md, "Testing tools"; the API: docs/api.md.
"""

from __future__ import annotations

import enum
import os
import random
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from runtime.backends.contract import Backend, BackendLoader
from runtime.backends.options import ModelOptions
from runtime.backends.simulated import ComputeClock, RealClock
from runtime.kernel.core import ActorCore
from runtime.messages import ModelSpec
from runtime.testing.fault_points import (
    FaultPoint,
    FaultyBackend,
    FaultyBatch,
    FaultyKeeper,
    without_faults,
)

# The wrappers and points are fault_points.py's; a test needs only this module.
__all__ = [
    "KINDS_AT",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "FaultPoint",
    "FaultyBackend",
    "FaultyBatch",
    "FaultyKeeper",
    "InjectedFault",
    "Injection",
    "without_faults",
]


class FaultKind(enum.StrEnum):
    """What a fault does at its point (module docstring)."""

    RAISE = "raise"
    SLOW = "slow"
    HANG = "hang"
    LOSE = "lose_process"  # the engine's process dies in this call (see ``FaultPlan.apply``)


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
            FaultPoint.PROBE,
            FaultPoint.TIDY,
        )
    },
}


def _kill_this_process(model: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class InjectedFault(RuntimeError):
    """Raised by a wrapped backend where the plan injects a fault (``RAISE``, or a released
    ``HANG``)."""


@dataclass(frozen=True)
class Fault:
    """Inject ``kind`` at ``point`` (of ``model``, or any model): the calls there after the first
    ``after`` clean ones, ``times`` of them (0: every one from then on). ``seconds``: how long a
    ``SLOW`` fault takes, or how long a ``RAISE`` runs before it raises (a step failing
    part-way). Raises ``ValueError`` for a kind the point cannot do."""

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
        # What a LOSE fault does to the engine of a model (the simulator sets it; None: raise).
        self.lose_process: Callable[[str], None] | None = None

    def __getstate__(self) -> dict[str, object]:
        """A copy for another process (an engine's Ray actor): the faults still to come, with a
        lock and a hang release of its own (releasing here lets nothing go there; killing the
        process does)."""
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"], state["_released"], state["lose_process"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._released = threading.Event()
        self.lose_process = _kill_this_process  # unpickled in an engine's process: lose it

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

    def disarm(self) -> None:
        """Forget every scripted fault (random ones, by ``rate``, go on while enabled)."""
        with self._lock:
            self._armed.clear()

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
        if fault.kind in (FaultKind.SLOW, FaultKind.RAISE):
            clock.spend(fault.seconds)
        if fault.kind is FaultKind.SLOW:
            return
        if fault.kind is FaultKind.LOSE and self.lose_process is not None:
            self.lose_process(model)
            if hang is not None:
                hang()  # the simulator: the lost engine's job never ends
            raise InjectedFault(f"injected process loss at {point} of model {model!r}")
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

            def at(point: FaultPoint) -> None:
                self.apply(point, spec.name, spend, hang)

            return FaultyBackend(loader(spec, options), at)

        return load

    def wrap_keeper(self, keeper: ActorCore) -> ActorCore:
        """The KV keeper's core, refusing sequences' reservations where the plan says."""
        return FaultyKeeper(keeper, lambda model: self.check(FaultPoint.RESERVE, model) is not None)
