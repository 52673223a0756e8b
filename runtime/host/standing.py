"""The standing actors (router, KV keeper, prefix-cache manager, and how engines are built) that a
``RuntimeConfig`` asks for: one reading of the config for the runtime (host/api.py) and the
simulator (runtime/testing/simulator.py), so the two cannot drift apart."""

from __future__ import annotations

from actors.standing import EngineHost, standing_actors
from runtime.backends.contract import BackendLoader
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import ActorCore, Address


def configured_actors(
    config: RuntimeConfig, load_backend: BackendLoader, engine_host: EngineHost | None = None
) -> list[tuple[Address, ActorCore]]:
    """The standing actors ``config`` asks for (the runtime's, and the simulator's)."""
    cluster = config.cluster
    return standing_actors(
        kv_budget_bytes=config.resolved_kv_budget_bytes(),
        load_backend=load_backend,
        reservation_timeout_s=config.reservation_timeout_s,
        default_max_tokens=config.default_max_tokens,
        strict_max_tokens=config.strict_max_tokens,
        step_timeout_s=config.step_timeout_s,
        engine_restart=config.engine_restart,
        stall_timeout_s=config.stall_timeout_s,
        auto_load=config.auto_load,
        engine_host=engine_host,
        node_kv_budgets=None if cluster is None else cluster.node_kv_budget_bytes,
        node_kv_default=None if cluster is None else cluster.kv_budget_bytes_per_node,
        disk_cache=config.disk_cache,
        routing_costs=None if cluster is None else cluster.routing_costs(),
    )
