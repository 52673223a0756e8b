"""Replicas: several engines serving one model name, and which one a request goes to.

A model loaded with ``ModelSpec.replicas`` N > 1 is N loads in the router's model table (``NAME@0``
… ``NAME@N-1``), each with its own epoch, restarts and prefix entries, so the prefix manager knows
which replica holds which prefix. A request with a session goes to its session's replica; any other
to the one with the least work queued, fewest live requests, least cached state. Once looked up,
it moves once, before it starts, to the replica with the lowest estimated time to first token
(actors/replica_costs.py), a session's request only to one holding more of it. Exact token
counts, not past request text. See docs/protocols.md, "Replicas and routing", and docs/cluster.md.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from actors.replica_costs import Queued, RoutingCosts, cheapest, queue_tokens
from runtime.kernel.core import Address, Context
from runtime.messages import CommandFailed, ModelLoaded, ModelSpec, ModelUnloaded

SEPARATOR = "@"
SESSIONS_KEPT = 4096  # sticky sessions remembered per model (least recently used forgotten)
# ModelSpec.routing: ours, and two that know nothing of caches (for comparison, bench/cluster.py).
ROUTING_POLICIES = ("affinity", "round_robin", "power_of_two")


def replica_name(model: str, index: int) -> str:
    return f"{model}{SEPARATOR}{index}"


def replica_base(name: str) -> str | None:
    """``NAME`` of a replica ``NAME@i``; None for other names."""
    base, mark, index = name.rpartition(SEPARATOR)
    return base if mark and base and index.isdigit() else None


@dataclass
class ReplicaSet:
    """One model's replicas and who waits on them."""

    spec: ModelSpec
    names: tuple[str, ...]
    load_asker: Address | None
    loading: set[str]
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    turn: int = 0  # round robin's next replica
    draws: random.Random = field(default_factory=lambda: random.Random(0))  # power of two's


@dataclass
class _Unloading:
    askers: list[Address]
    waiting: set[str]


@dataclass(frozen=True)
class ModelTable:
    """What the replicas need of the router's model table (``ModelLifecycle``)."""

    load: Callable[[ModelSpec, Address | None, Context], None]
    unload: Callable[[str, Address | None, Context], None]
    knows: Callable[[str], bool]
    serving: Callable[[str], bool]  # ready, or loading (a request waits for it)
    live: Callable[[str], int]  # live requests of its current epoch
    loaded: Callable[[str], ModelLoaded | None]
    # The live requests on a load, but one (a sequence id), as routing's estimate sees them.
    queued: Callable[[str, int | None], list[Queued]]


class Replicas:
    """The router's replica sets (see module docstring)."""

    def __init__(self, table: ModelTable, costs: RoutingCosts | None = None) -> None:
        self._table = table
        self._costs = costs or RoutingCosts()
        # Cached bytes per replica as the prefix manager last said: new sessions go to the least.
        self._resident: dict[str, int] = {}
        self._sets: dict[str, ReplicaSet] = {}
        self._unloading: dict[str, _Unloading] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._sets

    def names(self, name: str) -> tuple[str, ...]:
        rs = self._sets.get(name)
        return () if rs is None else rs.names

    # ------------------------------------------------------------------ load and unload

    def load(self, spec: ModelSpec, asker: Address, ctx: Context) -> None:
        """Load ``spec.replicas`` replicas; ``asker`` hears once, when all are in or one failed."""
        names = tuple(replica_name(spec.name, i) for i in range(spec.replicas))
        if spec.name in self._sets or self._table.knows(spec.name) or spec.name in self._unloading:
            text = f"model {spec.name!r} is already loaded; unload it first to load it anew"
            ctx.send(asker, CommandFailed(code="model_already_loaded", message=text))
            return
        self._sets[spec.name] = ReplicaSet(spec, names, asker, set(names))
        for name in names:
            # Each keeps ``replicas``: an engine placed on a cluster checks room for all of them.
            self._table.load(msgspec.structs.replace(spec, name=name), None, ctx)

    def engine_loaded(self, replica: str, failure: CommandFailed | None, ctx: Context) -> None:
        """Replica ``replica``'s load ended (``failure`` None: it is in)."""
        base = replica_base(replica)
        rs = None if base is None else self._sets.get(base)
        if rs is None or replica not in rs.loading:
            return  # a restart's reload, or not a replica
        rs.loading.discard(replica)
        if failure is not None:  # one failed: the whole load fails, the others are unloaded
            if rs.load_asker is not None:
                ctx.send(rs.load_asker, failure)
            rs.load_asker = None
            self.unload(rs.spec.name, None, ctx)
            return
        if rs.loading or rs.load_asker is None:
            return
        first = self._table.loaded(replica)
        if first is not None:
            ctx.send(rs.load_asker, msgspec.structs.replace(first, model=rs.spec.name))
        rs.load_asker = None

    def unload(self, name: str, asker: Address | None, ctx: Context) -> bool:
        """Unload every replica of ``name``; False if ``name`` has none."""
        rs = self._sets.pop(name, None)
        if rs is None:
            return False
        if rs.load_asker is not None:
            ctx.send(rs.load_asker, CommandFailed(code="model_unloading",
                                                  message="unloaded while loading"))  # fmt: skip
        for replica in rs.names:  # a later load starts with nothing cached
            self._resident.pop(replica, None)
        unloading = self._unloading.setdefault(name, _Unloading([], set()))
        if asker is not None:
            unloading.askers.append(asker)
        for replica in rs.names:
            if self._table.knows(replica):
                unloading.waiting.add(replica)
                self._table.unload(replica, None, ctx)
        for replica in rs.names:  # a failed one is gone at once, with no drain to wait for
            self.drained(replica, ctx)
        return True

    def drained(self, replica: str, ctx: Context) -> None:
        """``replica`` left the model table; its model's unload ends with its last replica."""
        base = replica_base(replica)
        unloading = None if base is None else self._unloading.get(base)
        if base is None or unloading is None or self._table.knows(replica):
            return
        unloading.waiting.discard(replica)
        if not unloading.waiting:
            del self._unloading[base]
            for asker in unloading.askers:
                ctx.send(asker, ModelUnloaded(model=base, epoch=0))

    def clear(self) -> None:
        """Shutdown: the table unloads every replica itself."""
        self._sets.clear()
        self._resident.clear()

    # ------------------------------------------------------------------ routing

    def route(self, name: str, session: str | None, avoid: str | None = None) -> str:
        """The replica of ``name`` a request goes to (see module docstring); ``avoid``: one that
        just failed. A replica none serves is still returned: the router refuses it by its state."""
        rs = self._sets[name]
        serving = [r for r in rs.names if r != avoid and self._table.serving(r)] or [rs.names[0]]
        if rs.spec.routing == "round_robin":
            rs.turn += 1
            return serving[rs.turn % len(serving)]
        if rs.spec.routing == "power_of_two":
            two = rs.draws.sample(serving, min(2, len(serving)))
            return min(two, key=self._table.live)
        if session is not None:
            kept = rs.sessions.get(session)
            if kept is not None and kept != avoid and self._table.serving(kept):
                rs.sessions.move_to_end(session)
                return kept
        chosen = min(serving, key=self._least_loaded)
        if session is not None:
            rs.sessions[session] = chosen
            rs.sessions.move_to_end(session)
            while len(rs.sessions) > SESSIONS_KEPT:
                rs.sessions.popitem(last=False)
        return chosen

    def holder(self, name: str, session: str) -> str:
        """The load that holds ``session`` of ``name`` (its replica, or ``name`` itself)."""
        rs = self._sets.get(name)
        return name if rs is None else rs.sessions.get(session, rs.names[0])

    def _least_loaded(self, replica: str) -> tuple[int, int, int]:
        """Where a request whose prompt is not known in tokens yet goes first."""
        queue = queue_tokens(self._table.queued(replica, None), self._costs)
        return queue, self._table.live(replica), self._resident.get(replica, 0)

    def destination(
        self,
        name: str,
        session: str | None,
        here: str,
        sequence_id: int,
        prompt: int,
        matches: Mapping[str, int],
        resident: Mapping[str, int],
    ) -> str:
        """The replica a request of ``name`` on ``here`` (sequence ``sequence_id``, ``prompt``
        tokens, ``matches``: what each replica holds of it) is first served from soonest
        (``here`` unless another one's estimate is lower; only with affinity routing). A
        request whose session is kept on ``here`` moves only to a replica holding more of it."""
        self._resident.update(resident)
        rs = self._sets.get(name)
        if rs is None or rs.spec.routing != "affinity":
            return here
        candidates = [r for r in rs.names if r == here or self._table.serving(r)]
        if session is not None and rs.sessions.get(session) == here:
            held = matches.get(here, 0)
            candidates = [r for r in candidates if r == here or matches.get(r, 0) > held]
        queues = {
            r: queue_tokens(self._table.queued(r, sequence_id), self._costs) for r in candidates
        }
        return cheapest(here, prompt, matches, queues, self._resident, self._costs)

    def stick(self, name: str, session: str | None, replica: str) -> None:
        """A moved request's session follows it."""
        rs = self._sets.get(name)
        if rs is not None and session is not None:
            rs.sessions[session] = replica
