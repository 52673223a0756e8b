"""Where a runtime's engines run when they run on Ray, and what each one needs.

A plain struct with no Ray import, so ``RuntimeConfig`` can carry it while the default install
stays without Ray. See docs/cluster.md.
"""

from __future__ import annotations

import msgspec

from actors.replica_costs import RoutingCosts
from runtime.errors import InvalidConfig


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Engines as Ray actors. ``address``: None starts a local Ray on this machine (loopback, no
    dashboard, ``num_cpus`` CPUs); ``"auto"`` joins the cluster ``ray start`` made on this
    machine; ``"HOST:PORT"`` joins a head started with ``ray start --head --port PORT``.
    Each engine process asks for ``engine_num_cpus`` CPUs, ``engine_num_gpus`` GPUs and
    ``engine_resources`` (custom resources, e.g. ``{"mac_studio": 1}``).
    Each node's engines reserve KV against that node's budget: ``node_kv_budget_bytes`` by Ray
    node id or node IP address, else ``kv_budget_bytes_per_node`` (None: the runtime's
    ``kv_budget_bytes``). ``grant_with_lookup``: a sequence's KV grant and its prefix lookup's
    answer reach the engine in one Ray call (False: one each, a crossing more per request; kept
    to measure the difference). ``routing_decode_step_tokens`` / ``routing_move_tokens``: the
    weights, in prefill tokens, of the estimated time to first token a model's replicas are
    chosen by (actors/replica_costs.py; docs/cluster.md, "Routing across replicas"): a decode
    step of a request already decoding on a replica, and moving a request off the replica that
    looked it up."""

    address: str | None = None
    num_cpus: int | None = None  # only for a local start: what Ray may schedule here
    engine_num_cpus: float = 1.0
    engine_num_gpus: float = 0.0
    engine_resources: dict[str, float] = {}
    connect_timeout_s: float = 60.0  # reaching the cluster (a local start included)
    placement_timeout_s: float = 60.0  # an engine process placed and started, its model aside
    poll_s: float = 1.0  # the longest an idle engine's mail poll waits before it asks again
    # An engine process whose loop answers no poll for this long is killed and restarted.
    unresponsive_s: float = 30.0
    node_kv_budget_bytes: dict[str, int] = {}
    kv_budget_bytes_per_node: int | None = None
    grant_with_lookup: bool = True
    routing_decode_step_tokens: int = 20
    routing_move_tokens: int = 4

    def __post_init__(self) -> None:
        for name, value in (
            ("engine_num_cpus", self.engine_num_cpus),
            ("engine_num_gpus", self.engine_num_gpus),
            ("connect_timeout_s", self.connect_timeout_s),
            ("placement_timeout_s", self.placement_timeout_s),
            ("poll_s", self.poll_s),
            ("unresponsive_s", self.unresponsive_s),
            ("routing_decode_step_tokens", self.routing_decode_step_tokens),
            ("routing_move_tokens", self.routing_move_tokens),
        ):
            if value < 0 or (name.endswith("_s") and value == 0):
                raise InvalidConfig(f"ClusterConfig.{name} must be > 0 (got {value!r})")
        budgets = {**self.node_kv_budget_bytes, "(per node)": self.kv_budget_bytes_per_node or 0}
        for node, nbytes in budgets.items():
            if nbytes < 0:
                raise InvalidConfig(
                    f"the KV budget of node {node!r} must be >= 0 bytes (got {nbytes!r})"
                )
        if self.num_cpus is not None and self.num_cpus < 1:
            raise InvalidConfig(f"ClusterConfig.num_cpus must be >= 1 (got {self.num_cpus!r})")

    def routing_costs(self) -> RoutingCosts:
        """The replica choice's weights (actors/replica_costs.py)."""
        return RoutingCosts(self.routing_decode_step_tokens, self.routing_move_tokens)

    def engine_needs(self) -> dict[str, float]:
        """What one engine process is placed with (Ray's resource names)."""
        needs = {"CPU": self.engine_num_cpus, "GPU": self.engine_num_gpus, **self.engine_resources}
        return {name: amount for name, amount in needs.items() if amount > 0}
