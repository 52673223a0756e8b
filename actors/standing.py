"""The standing actors every runtime starts: the router, the KV keeper and the prefix-cache manager.

Both transports (``runtime.kernel.actor`` in production, ``runtime.testing.simulator`` in tests)
spawn exactly this list, so a simulated run wires the same actors as a real one. Engines are not
standing: the router spawns one per loaded model through the factory built here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from actors.engine.core import EngineCore
from actors.kv_budget import KVBudgetCore
from actors.kv_ledgers import node_budget
from actors.prefix_cache import PrefixCacheCore
from actors.replica_costs import RoutingCosts
from actors.router import RouterCore
from runtime.backends.contract import BackendLoader
from runtime.backends.disk import DiskCacheConfig
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, ROUTER, ActorCore, Address
from runtime.kernel.supervision import RestartPolicy
from runtime.messages import ModelSpec

# Builds an engine's core on the Ray node it runs on: (node id, node IP) -> the core.
BuildOnNode = Callable[[str, str], ActorCore]
# Where an engine runs: (spec, epoch, build its core) -> the actor core at its address.
EngineHost = Callable[[ModelSpec, int, BuildOnNode], ActorCore]


def standing_actors(
    *,
    kv_budget_bytes: int,
    load_backend: BackendLoader,
    reservation_timeout_s: float,
    default_max_tokens: int,
    stall_timeout_s: float | None,
    step_timeout_s: float | None = None,
    engine_restart: RestartPolicy | None = None,
    auto_load: bool = True,
    strict_max_tokens: bool = False,
    engine_host: EngineHost | None = None,
    node_kv_budgets: Mapping[str, int] | None = None,
    node_kv_default: int | None = None,
    disk_cache: DiskCacheConfig | None = None,
    routing_costs: RoutingCosts | None = None,
) -> list[tuple[Address, ActorCore]]:
    """The standing actors with their addresses; engines load their model with ``load_backend``,
    and are restarted (their model reloaded) after a crash as ``engine_restart`` allows;
    ``auto_load``: a request for a loading or idle model waits for it rather than being refused;
    ``engine_host``: where an engine runs (given the spec, the epoch and how to build the engine
    core), e.g. a Ray actor of its own (runtime/cluster/); None: in this process;
    ``node_kv_budgets`` / ``node_kv_default``: the KV budget of an engine's Ray node (by node id
    or IP / any other; None: ``kv_budget_bytes``), the host's being ``kv_budget_bytes``;
    ``routing_costs``: the weights of the choice between a model's replicas (None: defaults)."""

    def engine_factory(spec: ModelSpec, epoch: int) -> ActorCore:
        if engine_host is not None:
            budgets, default = dict(node_kv_budgets or {}), node_kv_default or kv_budget_bytes

            def on_node(node: str, node_ip: str) -> ActorCore:
                # The engine plans (checkpoints) against the budget of the node its KV is on.
                return build_engine(spec, epoch, node_budget(budgets, default, node, node_ip))

            return engine_host(spec, epoch, on_node)
        return build_engine(spec, epoch, kv_budget_bytes)

    def build_engine(spec: ModelSpec, epoch: int, budget: int) -> ActorCore:
        return EngineCore(
            spec,
            epoch,
            load_backend,
            budget,
            reservation_timeout_s,
            default_max_tokens,
            step_timeout_s=step_timeout_s,
            strict_max_tokens=strict_max_tokens,
            disk=disk_cache,
        )

    return [
        (
            KV_KEEPER,
            KVBudgetCore(
                kv_budget_bytes,
                default_timeout_s=reservation_timeout_s,
                node_budgets=node_kv_budgets,
                node_default_bytes=node_kv_default,
            ),
        ),
        (PREFIX_CACHE, PrefixCacheCore()),
        (
            ROUTER,
            RouterCore(
                engine_factory,
                engine_restart or RestartPolicy(),
                stall_timeout_s=stall_timeout_s,
                auto_load=auto_load,
                routing_costs=routing_costs,
            ),
        ),
    ]
