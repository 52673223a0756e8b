"""A seeded soak of the whole runtime on the simulated backend: thousands of requests through the
production ``Runtime`` (real actor tasks, real compute threads), then a check that nothing leaked.

The plan (prompts, kinds, which requests are cancelled and how) is drawn from one seed; the
interleaving is whatever the event loop and the compute threads make of it, which is the point of
a soak. Nothing sleeps or times anything: cancels are made after a drawn number of a request's own
events, and the mid-run unload waits for a drawn number of requests to have ended.

``run_soak`` returns a ``SoakReport``; its ``problems()`` names every check that failed, so a test
and ``scripts/soak.py`` judge a run alike. See docs/reliability.md, "Soak".
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import anyio

from bench.soak.plan import (
    CancelHow,
    PlannedRequest,
    SoakConfig,
    expected_text,
    plan_requests,
    soak_models,
)
from runtime.errors import MlxRuntimeError
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Cancelled, Failed, Finished, ModelSpec, Started, TokensEmitted
from runtime.testing.harness import wait_until

# Named so by ``ActorSystem.start_timer``: a timer is a task that sleeps until its deadline, and
# cannot be cancelled. What may still sleep at quiescence, whatever the load: the KV keeper's one
# deadline and one half-way timer (actors/kv_timers.py), the router's one timer for its request
# guards (actors/deadlines.py), and each engine load's one watchdog timer and one idle
# housekeeping timer (actors/engine/tidying.py).
TIMER_TASK = "timer for "
KEEPER_TIMERS = 2
ROUTER_TIMERS = 1
ENGINE_LOADS = 3  # two models, one reloaded
TIMERS_PER_ENGINE = 2


@dataclass
class Outcome:
    """What one request's client saw."""

    planned: PlannedRequest
    terminals: list[str] = field(default_factory=list)  # type names, in order
    text: str = ""
    finish_reason: str | None = None
    rejected: str | None = None  # the code, when the router refused it (during the unload)
    path: str | None = None


@dataclass
class SoakReport:
    """What a soak saw, and the baselines it compares against."""

    outcomes: list[Outcome]
    tasks_before: int
    tasks_after: int
    threads_before: list[str]
    threads_after: list[str]
    # Inside the runtime: with the models loaded before the soak, and at quiescence after it.
    tasks_loaded: Counter[str]  # task names
    tasks_quiescent: Counter[str]
    threads_loaded: list[str]
    threads_quiescent: list[str]
    reserved_at_quiescence: int
    prefix_bytes_at_quiescence: int
    reserved_after_reset: int
    live_at_quiescence: dict[str, int]  # gauge name -> value, every one must be 0
    unrouted: dict[str, int]
    counters: dict[str, int]  # interesting totals over every actor, for the report

    def problems(self) -> list[str]:
        """Every check the run failed, as sentences (empty: it passed)."""
        found = [
            f"{name} is {value} at quiescence"
            for name, value in self.live_at_quiescence.items()
            if value
        ]
        if self.reserved_at_quiescence != self.prefix_bytes_at_quiescence:
            found.append(
                f"KV reserved {self.reserved_at_quiescence} B at quiescence, but the prefix cache "
                f"holds {self.prefix_bytes_at_quiescence} B"
            )
        if self.reserved_after_reset:
            found.append(f"KV reserved {self.reserved_after_reset} B after resetting every prefix")
        extra_tasks = self.tasks_quiescent - self.tasks_loaded
        keeper_timers = extra_tasks[f"{TIMER_TASK}kv"]
        router_timers = extra_tasks[f"{TIMER_TASK}router"]
        engine_timers = sum(n for name, n in extra_tasks.items() if name.startswith(TIMER_TASK))
        engine_timers -= keeper_timers + router_timers
        if (
            any(not name.startswith(TIMER_TASK) for name in extra_tasks)
            or keeper_timers > KEEPER_TIMERS
            or router_timers > ROUTER_TIMERS
            or engine_timers > TIMERS_PER_ENGINE * ENGINE_LOADS
        ):
            found.append(f"asyncio tasks left inside the runtime: {dict(extra_tasks)}")
        if self.threads_loaded != self.threads_quiescent:
            found.append(
                f"threads {self.threads_loaded} -> {self.threads_quiescent} in the runtime"
            )
        if self.tasks_before != self.tasks_after:
            found.append(
                f"asyncio tasks {self.tasks_before} before the runtime, {self.tasks_after} after"
            )
        if self.threads_before != self.threads_after:
            found.append(
                f"threads {self.threads_before} before the runtime, {self.threads_after} after"
            )
        if self.unrouted:
            found.append(f"events after their request's terminal: {self.unrouted}")
        found.extend(problem for o in self.outcomes if (problem := _outcome_problem(o)))
        return found

    @property
    def pending_timers(self) -> int:
        """Timer tasks still sleeping at quiescence (each until its deadline)."""
        return sum((self.tasks_quiescent - self.tasks_loaded).values())

    def tally(self) -> Counter[str]:
        """Requests by how they ended (``Finished:length``, ``rejected``, ``left``: the client
        left before its terminal, which the stream then took)."""
        return Counter(
            "rejected"
            if o.rejected
            else f"{o.terminals[-1]}:{o.finish_reason}"
            if o.terminals
            else "left"
            for o in self.outcomes
        )


def _outcome_problem(o: Outcome) -> str | None:
    p = o.planned
    if o.rejected is not None:
        return (
            None
            if o.rejected == "model_not_loaded"
            else f"request {p.index} rejected: {o.rejected}"
        )
    # A request left early saw its terminal only if it came first (the stream took it); a prewarm
    # whose task was cancelled before it was submitted has none at all.
    left = p.cancel is CancelHow.LEAVE or (p.prewarm and p.cancel is not CancelHow.NONE)
    if len(o.terminals) > 1 or (not o.terminals and not left):
        return f"request {p.index} saw terminals {o.terminals}"
    if p.prewarm:
        return None  # a prewarm shows no text; its one terminal is checked above
    want = expected_text(p.prompt, p.max_tokens)
    if o.terminals == ["Finished"] and o.finish_reason in ("stop", "length") and o.text != want:
        return (
            f"request {p.index} ({p.model}, {o.path}) finished with {o.text!r}, cold gives {want!r}"
        )
    if not want.startswith(o.text):
        return f"request {p.index} ({p.model}) produced {o.text!r}, not a prefix of {want!r}"
    return None


async def run_soak(config: SoakConfig) -> SoakReport:
    """Run the plan through a fresh ``Runtime``; raises only if the runtime itself fails."""
    tasks_before, threads_before = _task_count(), _thread_names()
    plan = plan_requests(config)
    outcomes = [Outcome(planned) for planned in plan]
    runtime_config = RuntimeConfig(kv_budget_bytes=config.budget_bytes)
    async with Runtime(runtime_config) as rt:
        models = soak_models(config)
        for spec in models:
            await rt.load_model(spec)
        tasks_loaded, threads_loaded = _task_names(), _thread_names()
        driver = _Driver(rt, config, models[0])
        async with anyio.create_task_group() as tg:
            tg.start_soon(driver.unload_and_reload)
            pending = iter(outcomes)
            async with anyio.create_task_group() as clients:
                for client in range(config.clients):
                    clients.start_soon(driver.client, client, pending)
            driver.unload_now()  # a plan shorter than ``unload_after`` reloads at its end
        await wait_until(rt, lambda: _quiescent(rt), what="every request and reservation ended")
        # An unloaded engine's task ends after the unload's reply, once its compute thread has
        # been joined (ActorSystem._shut_down); its end wakes ``wait_until`` like any progress.
        await wait_until(
            rt,
            lambda: _task_names() - tasks_loaded == _timers_only(_task_names() - tasks_loaded),
            what="every task but pending timers back to those after loading",
        )
        live = _live_gauges(rt)
        actors = rt.stats().actors
        reserved, prefix_bytes = actors["kv"].gauges["reserved"], actors["prefix"].gauges["bytes"]
        counters = _totals(rt)
        tasks_quiescent, threads_quiescent = _task_names(), _thread_names()
        for spec in models:
            await rt.reset(spec.name)
        await wait_until(
            rt, lambda: rt.stats().actors["kv"].gauges["reserved"] == 0, what="KV 0 after reset"
        )
        reserved_after_reset = rt.stats().actors["kv"].gauges["reserved"]
        unrouted = dict(rt.unrouted_events)
    return SoakReport(
        outcomes=outcomes,
        tasks_before=tasks_before,
        tasks_after=_task_count(),
        threads_before=threads_before,
        threads_after=_thread_names(),
        tasks_loaded=tasks_loaded,
        tasks_quiescent=tasks_quiescent,
        threads_loaded=threads_loaded,
        threads_quiescent=threads_quiescent,
        reserved_at_quiescence=reserved,
        prefix_bytes_at_quiescence=prefix_bytes,
        reserved_after_reset=reserved_after_reset,
        live_at_quiescence=live,
        unrouted=unrouted,
        counters=counters,
    )


class _Driver:
    """The clients and the mid-run unload, sharing one count of ended requests."""

    def __init__(self, rt: Runtime, config: SoakConfig, reloaded: ModelSpec) -> None:
        self._rt = rt
        self._config = config
        self._reloaded = reloaded
        self._ended = 0
        self._unload_due = anyio.Event()

    async def client(self, client: int, pending: Iterator[Outcome]) -> None:
        for outcome in pending:
            if outcome.planned.prewarm:
                await self._prewarm_then_generate(client, outcome, pending)
            else:
                await self._generate(outcome, session=None)
            self._count_ended()

    async def unload_and_reload(self) -> None:
        await self._unload_due.wait()
        await self._rt.unload_model(self._reloaded.name)
        await self._rt.load_model(self._reloaded)

    def unload_now(self) -> None:
        self._unload_due.set()

    def _count_ended(self) -> None:
        self._ended += 1
        if self._ended >= self._config.unload_after:
            self._unload_due.set()

    async def _prewarm_then_generate(
        self, client: int, warm: Outcome, pending: Iterator[Outcome]
    ) -> None:
        """The prewarm, then the generate it is for (the next planned request): after the
        prewarm's end (an exact hit), or beside it (adopted or superseded). A prewarm planned to
        be cancelled is left (its task cancelled) as soon as its generate has been submitted."""
        session = f"client-{client}"
        follow = next(pending, None)
        async with anyio.create_task_group() as tg:
            prewarm_scope, prewarm_ended = anyio.CancelScope(), anyio.Event()
            tg.start_soon(self._prewarm, warm, session, prewarm_scope, prewarm_ended)
            if warm.planned.follow_waits and warm.planned.cancel is CancelHow.NONE:
                await prewarm_ended.wait()
            if follow is not None:
                cancel_warm = warm.planned.cancel is not CancelHow.NONE
                await self._generate(
                    follow, session=session, submitted=prewarm_scope.cancel if cancel_warm else None
                )
                self._count_ended()

    async def _prewarm(
        self, outcome: Outcome, session: str, scope: anyio.CancelScope, ended: anyio.Event
    ) -> None:
        try:
            with scope:
                await self._run_prewarm(outcome, session)
        finally:
            ended.set()

    async def _run_prewarm(self, outcome: Outcome, session: str) -> None:
        p = outcome.planned
        try:
            terminal = await self._rt.prewarm(
                p.model,
                p.prompt,
                max_tokens=p.max_tokens,
                session=session,
                request_id=self._request_id(outcome),
            )
        except MlxRuntimeError as error:
            outcome.rejected = error.code
            return
        outcome.terminals.append(type(terminal).__name__)
        outcome.finish_reason = (
            terminal.reason if isinstance(terminal, (Finished, Cancelled)) else terminal.code
        )

    async def _generate(
        self, outcome: Outcome, session: str | None, submitted: Callable[[], None] | None = None
    ) -> None:
        p = outcome.planned
        request_id = self._request_id(outcome)
        seen = 0
        try:
            async with self._rt.generate(
                p.model, p.prompt, max_tokens=p.max_tokens, session=session, request_id=request_id
            ) as stream:
                if submitted is not None:
                    submitted()
                if p.cancel is CancelHow.BY_ID and p.cancel_after == 0:
                    await self._rt.cancel(request_id)
                async for event in stream:
                    seen += 1
                    match event:
                        case Started(path=path):
                            outcome.path = path.value
                        case TokensEmitted(text=text):
                            outcome.text += text
                        case Finished(reason=reason):
                            outcome.terminals.append("Finished")
                            outcome.finish_reason = reason.value
                        case Cancelled(reason=reason):
                            outcome.terminals.append("Cancelled")
                            outcome.finish_reason = reason
                        case Failed(code=code):
                            outcome.terminals.append("Failed")
                            outcome.finish_reason = code
                    if seen == p.cancel_after and p.cancel is CancelHow.BY_ID:
                        await self._rt.cancel(request_id)
                    if seen >= p.cancel_after and p.cancel is CancelHow.LEAVE:
                        break
        except MlxRuntimeError as error:
            outcome.rejected = error.code

    @staticmethod
    def _request_id(outcome: Outcome) -> str:
        return f"soak-{outcome.planned.index}"


def _quiescent(rt: Runtime) -> bool:
    actors = rt.stats().actors
    return (
        not any(_live_gauges(rt).values())
        and actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]
    )


def _timers_only(tasks: Counter[str]) -> Counter[str]:
    return Counter({name: n for name, n in tasks.items() if name.startswith(TIMER_TASK)})


def _live_gauges(rt: Runtime) -> dict[str, int]:
    """Every gauge that counts live work; each is 0 once the runtime has nothing to do."""
    actors = rt.stats().actors
    live = {
        "router.live_requests": actors["router"].gauges["live_requests"],
        "kv.queued": actors["kv"].gauges["queued"],
        "prefix.leases": actors["prefix"].gauges["leases"],
    }
    for address, stats in actors.items():
        if address.startswith("engine:"):
            for gauge in ("sequences", "batch_size", "batch_padding_bytes", "pending_snapshots"):
                live[f"{address}.{gauge}"] = stats.gauges[gauge]
    return live


def _totals(rt: Runtime) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for stats in rt.stats().actors.values():
        totals.update(stats.counters)
    return dict(totals)


def _task_count() -> int:
    return len(asyncio.all_tasks())


def _task_names() -> Counter[str]:
    """Live tasks by name, an engine's without its epoch (a reload makes a new one)."""
    return Counter(_without_epoch(task.get_name()) for task in asyncio.all_tasks())


def _without_epoch(name: str) -> str:
    return re.sub(r"#\d+", "", name)


def _thread_names() -> list[str]:
    """Live threads but anyio's idle workers, which anyio keeps up to 10 s for reuse (the
    runtime joins an engine's executor through one), each engine's without its epoch (a reload
    makes a new one): ``engine:m_0`` for ``engine:m#3_0``."""
    return sorted(
        _without_epoch(t.name) for t in threading.enumerate() if t.name != "AnyIO worker thread"
    )
