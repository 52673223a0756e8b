"""The actor simulator: the real actor cores on a virtual clock, in an order chosen by a seed.

Races between actors are found by trying orders, not by luck: this replaces the production transport
(``runtime.kernel.actor``) with a single-threaded loop that at each step picks, with a seeded random
source, one actor that has mail and delivers one message to it; compute jobs run inline and their
simulated cost advances the virtual clock. Same seed, same trace, so a race found once is found
again and Hypothesis can shrink it. A caller may pass its own ``order`` (e.g.
``st.randoms(use_true_random=False)``) so each choice of actor is a drawn value.

Its use from a host's tests: docs/api.md, "Simulator for hosts' tests".
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.engine.core import EngineCore
from actors.engine.lost import LostEngine
from runtime.backends.loader import make_backend_loader
from runtime.host.config import RuntimeConfig
from runtime.host.standing import configured_actors
from runtime.kernel.core import KV_KEEPER, ROUTER, ActorCore, Address
from runtime.messages import (
    Cancelled,
    Failed,
    Finished,
    LoadModel,
    Message,
    ModelSpec,
    Rejected,
    TokensEmitted,
)
from runtime.testing.faults import FaultPlan

HOST: Address = "host"


class ActorOrder(Protocol):
    """Where the simulator takes "which ready actor runs next" from (``random.Random`` is one)."""

    def choice(self, seq: Sequence[Address], /) -> Address: ...


class VirtualClock:
    """Simulated time. Compute charges its cost here; the simulator moves ``now`` forward."""

    def __init__(self) -> None:
        self.now = 0.0
        self._charged = 0.0
        self._hung = False

    def spend(self, seconds: float) -> None:
        self._charged += seconds

    def hang(self) -> None:
        """The running job never returns: its ``done`` is never delivered (a fault plan's hang)."""
        self._hung = True

    def take_charged(self) -> float:
        charged, self._charged = self._charged, 0.0
        return charged

    def take_hung(self) -> bool:
        hung, self._hung = self._hung, False
        return hung


@dataclass(frozen=True)
class _JobDone:
    """A compute job ended: ``done`` goes to its actor, and the actor's next queued job starts.

    ``generation`` is the actor's compute generation when the job started: an abandoned job's end
    is dropped."""

    done: Message
    generation: int


@dataclass(frozen=True)
class _Background:
    """An I/O job (``Context.background``) due to run: it runs when time reaches it, after the
    mail before it (so an abort can come first, as on a real I/O thread), then ``done`` is mailed.
    It takes no virtual time."""

    job: Callable[[], None]
    done: Message


@dataclass(frozen=True)
class _Envelope:
    message: Message | None  # None: stop the actor
    sender: Address


class _SimContext:
    """A ``Context`` (runtime.kernel.core) that queues effects, applied after ``handle``."""

    def __init__(self, sim: Simulator, address: Address) -> None:
        self._sim = sim
        self._address = address
        self.effects: list[Callable[[], None]] = []

    @property
    def self_address(self) -> Address:
        return self._address

    def now(self) -> float:
        return self._sim.clock.now

    def send(self, to: Address, message: Message) -> None:
        self.effects.append(lambda: self._sim.deliver(to, message, self._address))

    def send_later(self, delay_s: float, message: Message) -> None:
        due = self._sim.clock.now + delay_s
        self.effects.append(lambda: self._sim.at(due, self._address, message))

    def spawn(self, address: Address, core: ActorCore) -> None:
        self.effects.append(lambda: self._sim.spawn(address, core))

    def stop(self, address: Address) -> None:
        self.effects.append(lambda: self._sim.deliver_stop(address))

    def compute(self, job: Callable[[], None], done: Message) -> None:
        self.effects.append(lambda: self._sim.run_inline(self._address, job, done))

    def background(self, job: Callable[[], None], done: Message) -> None:
        due = self._sim.clock.now
        self.effects.append(lambda: self._sim.at(due, self._address, _Background(job, done)))

    def abandon_compute(self) -> None:
        self.effects.append(lambda: self._sim.abandon_compute(self._address))

    def count_dead_letter(self, reason: str) -> None:
        self._sim.dead_letters[reason] += 1


class Simulator:
    """Drives the runtime's actor cores deterministically. Not thread-safe; no event loop needed."""

    def __init__(
        self,
        seed: int = 0,
        config: RuntimeConfig | None = None,
        faults: FaultPlan | None = None,
        order: ActorOrder | None = None,
    ) -> None:
        """``order`` picks the next ready actor (default: ``random.Random(seed)``)."""
        self.clock = VirtualClock()
        self.rng: ActorOrder = order if order is not None else random.Random(seed)
        self.config = config or RuntimeConfig(kv_budget_bytes=64 << 20)
        self.dead_letters: Counter[str] = Counter()
        self.host_messages: list[Message] = []
        self.trace: list[str] = []
        self._cores: dict[Address, ActorCore] = {}
        self._mail: dict[Address, deque[_Envelope]] = {}
        self._timers: list[tuple[float, int, Address, Message | _JobDone | _Background]] = []
        # Compute runs one job at a time per actor, in order, like its executor.
        self._computing: set[Address] = set()
        self._compute_queue: dict[Address, deque[tuple[Callable[[], None], Message]]] = {}
        self._compute_generation: Counter[Address] = Counter()  # grows when abandoned
        self._order = itertools.count()
        self._asks = 0
        self._replies: dict[Address, list[Message]] = {}
        self._step_checks: list[Callable[[], None]] = []
        self._running_on: Address = ""  # the actor whose compute job runs inline now
        self.lost_engines = 0  # engine processes lost to a LOSE fault
        self.faults = faults
        loader = make_backend_loader(self.clock)
        if faults is not None:
            loader = faults.wrap_loader(loader, self.clock, hang=self.clock.hang)
            faults.lose_process = self._lose_engine
        for address, core in configured_actors(self.config, loader):
            if faults is not None and address == KV_KEEPER:
                core = faults.wrap_keeper(core)
            self.spawn(address, core)

    # ------------------------------------------------------------------ host side

    def send(self, message: Message, sender: Address = HOST) -> None:
        """Send from the host to the router (or another sender address, for replies)."""
        self.deliver(ROUTER, message, sender)

    def ask(self, message: Message, max_seconds: float = 3600.0) -> Message:
        """Send a command from a fresh reply address and run until its one reply arrives."""
        self._asks += 1
        reply_to = f"{HOST}:ask:{self._asks}"
        self._replies[reply_to] = []
        self.send(message, sender=reply_to)
        self.run_until(lambda: bool(self._replies[reply_to]), max_seconds)
        return self._replies.pop(reply_to)[0]

    def load(self, spec: ModelSpec) -> Message:
        """Load a model and run until its reply (``ModelLoaded`` or ``CommandFailed``) arrives."""
        return self.ask(LoadModel(spec=spec))

    def events(self, request_id: str, incarnation: int) -> list[Message]:
        """Host events of one request, in arrival order."""
        return [
            m
            for m in self.host_messages
            if getattr(m, "request_id", None) == request_id
            and getattr(m, "incarnation", None) == incarnation
        ]

    def emitted_tokens(self, request_id: str, incarnation: int) -> list[int]:
        """Every token id the request emitted so far, in order."""
        return [
            token
            for event in self.events(request_id, incarnation)
            if isinstance(event, TokensEmitted)
            for token in event.token_ids
        ]

    def terminal(self, request_id: str, incarnation: int) -> Message | None:
        ends = (Finished, Cancelled, Failed, Rejected)
        found = [m for m in self.events(request_id, incarnation) if isinstance(m, ends)]
        return found[-1] if found else None

    def core(self, address: Address) -> ActorCore | None:
        return self._cores.get(address)

    def addresses(self) -> list[Address]:
        return list(self._cores)

    def check_every_step(self, check: Callable[[], None]) -> None:
        """Run ``check()`` after every delivered message: an invariant that must hold between any
        two messages, not only when a test looks (it raises to fail)."""
        self._step_checks.append(check)

    # ------------------------------------------------------------------ stepping

    def step(self) -> bool:
        """Deliver one message to an actor chosen by ``order`` (by default the seed's); False when
        every mailbox is empty."""
        ready = [address for address, mail in self._mail.items() if mail]
        if not ready:
            return False
        address = self.rng.choice(ready)
        envelope = self._mail[address].popleft()
        core = self._cores[address]
        ctx = _SimContext(self, address)
        if envelope.message is None:
            core.on_stop(ctx)
            del self._cores[address], self._mail[address]
            self.trace.append(f"{self.clock.now:.6f} stop {address}")
        else:
            name = type(envelope.message).__name__
            self.trace.append(f"{self.clock.now:.6f} {envelope.sender}->{address} {name}")
            core.handle(envelope.message, envelope.sender, ctx)
        for effect in ctx.effects:
            effect()
        for check in self._step_checks:
            check()
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Deliver messages until no actor has mail (time does not move)."""
        for _ in range(max_steps):
            if not self.step():
                return
        raise RuntimeError(f"simulation did not go idle within {max_steps} steps")

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, firing timers and compute completions on the way."""
        until = self.clock.now + seconds
        self.run_until_idle()
        while self._timers and self._timers[0][0] <= until:
            due, _, address, message = heapq.heappop(self._timers)
            self.clock.now = max(self.clock.now, due)
            self._fire(address, message)
            self.run_until_idle()
        self.clock.now = until

    def fire_next_timer(self) -> bool:
        """Deliver the mail there is (time never moves past waiting mail), then move time to the
        earliest pending timer (or compute completion) and deliver only it: what it leads to
        waits for ``step``, so a test can act in between. False if no timer is pending."""
        self.run_until_idle()
        if not self._timers:
            return False
        due, _, address, message = heapq.heappop(self._timers)
        self.clock.now = max(self.clock.now, due)
        self._fire(address, message)
        return True

    def _fire(self, address: Address, message: Message | _JobDone | _Background) -> None:
        if isinstance(message, _JobDone):
            self._job_done(address, message)
        elif isinstance(message, _Background):
            message.job()
            self.deliver(address, message.done, address)
        else:
            self.deliver(address, message, address)

    def run_until(self, condition: Callable[[], bool], max_seconds: float = 3600.0) -> None:
        """Run, jumping time to each next event, until ``condition()`` holds (raise if never)."""
        deadline = self.clock.now + max_seconds
        self.run_until_idle()
        while not condition():
            if not self._timers or self._timers[0][0] > deadline:
                raise RuntimeError("simulation stalled before the condition held")
            self.advance(self._timers[0][0] - self.clock.now)

    def run_until_quiescent(self, max_seconds: float = 3600.0) -> None:
        """Run until no mail and no pending timer or compute remains."""
        self.run_until(lambda: not self._timers and not any(self._mail.values()), max_seconds)

    @property
    def quiescent(self) -> bool:
        return not self._timers and not any(self._mail.values())

    # ------------------------------------------------------------------ transport (for contexts)

    def deliver(self, to: Address, message: Message, sender: Address) -> None:
        if to in self._replies:
            self._replies[to].append(message)
            return
        if to == HOST or to.startswith(f"{HOST}:"):
            self.host_messages.append(message)
            return
        mail = self._mail.get(to)
        if mail is None:
            self.dead_letters[f"no_actor:{type(message).__name__}"] += 1
            return
        mail.append(_Envelope(message, sender))

    def deliver_stop(self, address: Address) -> None:
        mail = self._mail.get(address)
        if mail is not None:
            mail.append(_Envelope(None, address))

    def at(self, due: float, address: Address, message: Message | _Background) -> None:
        heapq.heappush(self._timers, (due, next(self._order), address, message))

    def spawn(self, address: Address, core: ActorCore) -> None:
        if address in self._cores:
            raise ValueError(f"an actor already lives at {address!r}")
        self._cores[address] = core
        self._mail[address] = deque()
        ctx = _SimContext(self, address)
        core.on_start(ctx)
        for effect in ctx.effects:
            effect()

    def run_inline(self, address: Address, job: Callable[[], None], done: Message) -> None:
        """Run a compute job now, or once the actor's running one ends (its executor runs one at
        a time, in order); its charged cost decides when ``done`` arrives."""
        if address in self._computing:
            self._compute_queue.setdefault(address, deque()).append((job, done))
            return
        self._computing.add(address)
        self.clock.take_charged()
        self.clock.take_hung()
        self._running_on = address
        job()
        due = self.clock.now + self.clock.take_charged()
        if self.clock.take_hung():  # it never returns: the actor's later jobs wait behind it
            return
        ended = _JobDone(done, self._compute_generation[address])
        heapq.heappush(self._timers, (due, next(self._order), address, ended))

    def _lose_engine(self, model: str) -> None:
        """The "engine process lost" fault (``FaultKind.LOSE``), from the engine's running job."""
        self.lose_engine(self._running_on)

    def lose_engine(self, address: Address) -> None:
        """Lose the process of the engine at ``address`` now: its core is replaced by the
        host-side stand-in a lost Ray process leaves (``LostEngine``), which releases the epoch
        and reports the loss; its jobs are given up. A drain it had been asked for is answered,
        as the Ray proxy remembers the drains it forwarded."""
        engine = self._cores[address]
        assert isinstance(engine, EngineCore), f"{address} is not an engine"
        lost = LostEngine(engine.model, engine.epoch, "injected", engine.drain_requester)
        self._cores[address] = lost
        self.lost_engines += 1
        self.abandon_compute(address)
        ctx = _SimContext(self, address)
        lost.on_start(ctx)
        for effect in ctx.effects:
            effect()

    def abandon_compute(self, address: Address) -> None:
        """Give up the actor's running and queued jobs (``Context.abandon_compute``)."""
        self._compute_generation[address] += 1
        self._computing.discard(address)
        for _, done in self._compute_queue.pop(address, deque()):
            self.dead_letters[f"abandoned_compute:{type(done).__name__}"] += 1

    def _job_done(self, address: Address, ended: _JobDone) -> None:
        """Deliver ``done``; the next queued job starts at once, before the actor handles it."""
        if ended.generation != self._compute_generation[address]:
            self.dead_letters[f"abandoned_compute:{type(ended.done).__name__}"] += 1
            return
        self._computing.discard(address)
        self.deliver(address, ended.done, address)
        queued = self._compute_queue.get(address)
        if queued:
            job, next_done = queued.popleft()
            self.run_inline(address, job, next_done)
