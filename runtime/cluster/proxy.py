"""An engine's face on the host when the engine runs in a Ray actor of its own.

``RemoteEngine`` is an ordinary actor core at the engine's address, so the router, the keeper and
the prefix manager talk to it exactly as to an engine in the host's process, and every message
the engine sends comes out of it with the engine's address as its sender. It forwards its mail to
the engine's process in the wire form (numbered Ray calls, grouped by inbox.py) and collects the
engine's mail with a long poll run as its compute job (the one blocking ``ray.get`` is on the
proxy's own thread, never the event loop), handing each collected message on. Ray supervises
the process; when it dies (killed, out of memory, a native crash) or stops answering, the poll
says so and the proxy becomes a ``LostEngine`` (actors/engine/lost.py): the epoch's entries and
bytes are released and the router restarts the model in a new process. Stopping the proxy kills
the process, so a stuck compute thread dies with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.engine.lost import LostEngine
from actors.standing import BuildOnNode
from runtime.cluster.inbox import Inbox
from runtime.cluster.outbox import Wired
from runtime.errors import ClusterResourcesMissing, ModelLoadFailed
from runtime.kernel.core import KV_KEEPER, ROUTER, Address, Context
from runtime.kernel.stats import Counters
from runtime.messages import (
    ComputeDone,
    Drain,
    EngineLoadFailed,
    EnginePlaced,
    EngineReady,
    Message,
    Stats,
    decode,
)

log = logging.getLogger("mlx_actor_runtime.cluster")


@dataclass
class _Poll:
    """One collection of the engine's mail (run on the proxy's thread; never raises)."""

    handle: Any
    wait_s: float
    unresponsive_s: float
    start: Any = None  # the process's start call, on the first poll
    start_timeout_s: float = 0.0
    items: list[Wired] = field(default_factory=list)
    stats: bytes | None = None
    started: tuple[int, str, str, int] | None = None  # its pid, node, IP, niceness: 1st poll
    unplaced: bool = False
    lost: str | None = None  # why the process is gone

    def run(self) -> None:
        import ray

        try:
            if self.start is not None:
                self.started = ray.get(self.start, timeout=self.start_timeout_s)
            self.items, self.stats = ray.get(
                self.handle.take.remote(self.wait_s), timeout=self.wait_s + self.unresponsive_s
            )
        except ray.exceptions.GetTimeoutError:
            if self.start is not None and self.started is None:
                self.unplaced = True
            else:
                self.lost = f"it answered no poll for {self.unresponsive_s:g} s"
        except ray.exceptions.RayError as error:
            self.lost = _first_line(error)


@dataclass(frozen=True)
class EngineLink:
    """What the proxy needs of the cluster (``runtime.cluster.connect.ClusterLink`` makes it)."""

    start_engine: Callable[[Address, BuildOnNode], Any]
    kill: Callable[[Any], None]
    missing: Callable[[int], str | None]  # why N engines can never be placed, or None
    needs: dict[str, float]
    poll_s: float
    placement_timeout_s: float
    unresponsive_s: float
    grant_with_lookup: bool = True  # a grant crosses with its lookup's answer (inbox.py)


class RemoteEngine:
    """The host-side stand-in of an engine in a Ray actor (see module docstring)."""

    def __init__(
        self,
        model: str,
        epoch: int,
        build: BuildOnNode,
        link: EngineLink,
        replicas: int = 1,
    ) -> None:
        self.model = model
        self._replicas = replicas  # of its model: the cluster must have room for all of them
        self.epoch = epoch
        self._build = build
        self._link = link
        self._address = ""
        self._handle: Any = None
        self._sent = 0  # batches forwarded (numbered from 1)
        self._polls = 0
        self._drain_requester: Address | None = None
        self._lost: LostEngine | None = None
        self._closed = False
        self._stats: Stats | None = None
        self.pid = 0
        self.node = ""
        self.niceness = 0
        self.counters = Counters()
        self._inbox = Inbox(self.counters, link.grant_with_lookup)

    def on_start(self, ctx: Context) -> None:
        self._address = ctx.self_address
        missing = self._link.missing(self._replicas)
        if missing is not None:
            self._refuse(missing, ctx)
            return
        try:
            self._handle = self._link.start_engine(self._address, self._build)
        except Exception as error:  # e.g. the loader cannot be sent to another process
            self._refuse(f"the engine process of model {self.model!r} could not be started: "
                         f"{_first_line(error)}", ctx, code=ModelLoadFailed.code)  # fmt: skip
            return
        self._poll(ctx, start=self._handle.start.remote())

    def on_stop(self, ctx: Context) -> None:
        """Kill the process: whatever it still runs (a stuck compute step) dies with it."""
        if self._handle is not None:
            self._link.kill(self._handle)
            self._handle = None

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        if isinstance(message, ComputeDone) and sender == self._address:
            self._collected(message.job_id, ctx)
        elif self._lost is not None:
            self._lost.handle(message, sender, ctx)
        elif self._closed or self._handle is None:
            ctx.count_dead_letter("engine_process_closed")
        else:
            if isinstance(message, Drain) and message.epoch == self.epoch:
                self._drain_requester = sender
            self._deliver(self._inbox.put(sender, message))

    def statistics(self) -> Stats:
        if self._lost is not None:
            return self._lost.statistics()
        known = self._stats
        gauges = {"process_id": self.pid, "process_niceness": self.niceness,
                  **({} if known is None else known.gauges)}  # fmt: skip
        counters = {**self.counters.snapshot(), **({} if known is None else known.counters)}
        limits = {} if known is None else known.limits
        return Stats(actor=self._address, counters=counters, gauges=gauges, limits=limits)

    def _deliver(self, items: list[Wired]) -> None:
        """One Ray call with ``items`` (none: nothing to call for); not awaited: the numbers
        keep the order, and a process that is gone shows in the next poll."""
        if not items or self._handle is None:
            return
        self._sent += 1
        self.counters.inc("transport_calls_out")
        self.counters.inc("transport_messages_out", len(items))
        self._handle.deliver.remote(self._sent, items)

    # ------------------------------------------------------------------ collecting

    def _poll(self, ctx: Context, start: Any = None) -> None:
        self._polls += 1
        link = self._link
        poll = _Poll(
            self._handle, link.poll_s, link.unresponsive_s, start, link.placement_timeout_s
        )
        self._pending = poll
        ctx.compute(poll.run, ComputeDone(job_id=self._polls))

    def _collected(self, job_id: int, ctx: Context) -> None:
        poll = self._pending
        if job_id != self._polls or self._lost is not None or self._handle is None:
            return
        if poll.started is not None:
            self.pid, self.node, node_ip, self.niceness = poll.started
            log.info("engine %s runs in process %d on Ray node %s", self._address, self.pid,
                     self.node[:12])  # fmt: skip
            note = niceness_note(self.niceness, os.nice(0))
            if note is not None:
                log.warning("engine %s: %s", self._address, note)
            # Before any of the engine's mail: its reservations are booked on its node's budget.
            placed = EnginePlaced(model=self.model, epoch=self.epoch, node=self.node,
                                  node_ip=node_ip)  # fmt: skip
            ctx.send(KV_KEEPER, placed)
        if poll.unplaced:
            self._refuse(self._unplaced_text(), ctx)
            return
        if poll.lost is not None:
            self._lose(poll.lost, ctx)
            return
        if poll.stats is not None:
            stats = decode(poll.stats)
            self._stats = stats if isinstance(stats, Stats) else self._stats
        self.counters.inc("transport_batches_in")
        self._deliver(self._inbox.take())  # a grant whose lookup's answer never came: on alone
        for to, data in poll.items:
            message = decode(data)
            self._inbox.sent_by_engine(message)
            if isinstance(message, EngineReady):  # the router lists where each engine runs
                where = f"node {self.node[:8]} pid {self.pid}"
                message = msgspec.structs.replace(message, placement=where)
            ctx.send(to, message)
        self._poll(ctx)

    def _lose(self, why: str, ctx: Context) -> None:
        log.error("engine %s: its process %d was lost (%s)", self._address, self.pid, why)
        self._link.kill(self._handle)
        self._handle = None
        lost = LostEngine(self.model, self.epoch, why, self._drain_requester, self.counters)
        self._lost = lost
        lost.on_start(ctx)

    def _refuse(self, text: str, ctx: Context, code: str = ClusterResourcesMissing.code) -> None:
        if self._handle is not None:
            self._link.kill(self._handle)
            self._handle = None
        self._closed = True
        ctx.send(ROUTER, EngineLoadFailed(epoch=self.epoch, code=code, message=text))

    def _unplaced_text(self) -> str:
        link = self._link
        return (
            f"the engine process of model {self.model!r} could not be placed within "
            f"{link.placement_timeout_s:g} s: it needs {_amounts(link.needs)} and the cluster has "
            "not had that free; free some (unload a model, add a node) or ask for less "
            "(ClusterConfig.engine_num_cpus, engine_num_gpus, engine_resources)"
        )


def niceness_note(engine: int, host: int) -> str | None:
    """What to say when an engine process computes at a lower CPU priority than the host (None:
    it does not). Ray nices its workers by ``worker_niceness`` (15 unless set): under load its
    prefills then lose the CPU to any other work (docs/cluster.md, "Figures")."""
    if engine <= host:
        return None
    return (
        f"its process runs at niceness {engine}, the host at {host}: its compute loses the CPU to "
        "other work on the node; start the Ray nodes with RAY_worker_niceness=0 in their "
        "environment (`RAY_worker_niceness=0 ray start ...`); a Ray this runtime starts does so"
    )


def _amounts(needs: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in sorted(needs.items())) or "nothing"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
