"""The KV keeper's books per node: each node's budget and reserved bytes, and who is where.

An engine's KV lives in its node's memory, so its reservations are checked against its node's
budget, never against another node's free bytes (docs/cluster.md, "Where the actors live"). An
engine in the host's process is on ``HOST_NODE``, whose budget is the runtime's; an engine on a
Ray node is placed there by ``EnginePlaced`` (its proxy sends it before any of the engine's mail),
and that node's ledger is opened with its configured budget. A holder stays in the ledger it was
first granted in until it is released (a transfer's target joins its source's), so a placement
that arrives late can never move bytes between nodes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from runtime.messages import Holder

HOST_NODE = "host"  # the ledger of engines in the host's own process


def node_budget(budgets: Mapping[str, int], default: int, node: str, node_ip: str) -> int:
    """A Ray node's KV budget: ``budgets`` by its node id, else by its IP address, else
    ``default``. The keeper's ledger and the engine's own planning (checkpoints) ask this one."""
    budget = budgets.get(node, budgets.get(node_ip))
    return default if budget is None else budget


@dataclass
class Ledger:
    """One node's budget and the bytes granted on it."""

    node: str
    budget: int
    reserved: int = 0

    @property
    def free(self) -> int:
        return self.budget - self.reserved


class Ledgers:
    """Every node's ledger, each model epoch's node and each holder's node."""

    def __init__(
        self, host_budget: int, node_budgets: Mapping[str, int], node_default: int
    ) -> None:
        """``node_budgets``: a Ray node's budget by its node id or IP address; any other node
        has ``node_default``."""
        self._ledgers = {HOST_NODE: Ledger(HOST_NODE, host_budget)}
        self._node_budgets = dict(node_budgets)
        self._node_default = node_default
        self._placed: dict[tuple[str, int], str] = {}
        self._of_holder: dict[Holder, str] = {}

    def __iter__(self) -> Iterator[Ledger]:
        return iter(self._ledgers.values())

    def __getitem__(self, node: str) -> Ledger:
        return self._ledgers[node]

    @property
    def spread(self) -> bool:
        """Whether any engine was ever placed off the host (else one ledger, as before)."""
        return len(self._ledgers) > 1

    def place(self, model: str, epoch: int, node: str, node_ip: str) -> Ledger:
        """The engine of (model, epoch) runs on ``node``: its new holders go to that ledger."""
        self._placed[(model, epoch)] = node
        if node not in self._ledgers:
            budget = node_budget(self._node_budgets, self._node_default, node, node_ip)
            self._ledgers[node] = Ledger(node, budget)
        return self._ledgers[node]

    def forget_epoch(self, model: str, epoch: int) -> None:
        self._placed.pop((model, epoch), None)

    def for_holder(self, holder: Holder) -> Ledger:
        """Where ``holder``'s bytes are: where it holds already, else its engine's node."""
        node = self._of_holder.get(holder)
        if node is None:
            node = self._placed.get((holder.model, holder.epoch), HOST_NODE)
        return self._ledgers[node]

    def holds(self, holder: Holder) -> str | None:
        """The node ``holder`` holds bytes on (None: it holds nothing)."""
        return self._of_holder.get(holder)

    def hold(self, holder: Holder, ledger: Ledger) -> None:
        self._of_holder[holder] = ledger.node

    def forget(self, holder: Holder) -> Ledger:
        """``holder`` is released: the ledger it held on."""
        return self._ledgers[self._of_holder.pop(holder)]

    def epochs_on(self, node: str) -> tuple[tuple[str, int], ...] | None:
        """The (model, epoch) pairs holding bytes on ``node``, for a scoped ``Evict`` (None while
        every engine is on the host: any entry frees the one budget)."""
        if not self.spread:
            return None
        return tuple(sorted({(h.model, h.epoch) for h, n in self._of_holder.items() if n == node}))
