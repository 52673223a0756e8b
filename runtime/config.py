"""Configuration of a runtime, and the one place that builds its standing actors."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from actors.engine import EngineCore
from actors.kv_budget import KVBudgetCore
from actors.prefix_cache import PrefixCacheCore
from actors.router import RouterCore
from runtime.backend import BackendLoader
from runtime.coalesce import CoalescePolicy
from runtime.core import KV_KEEPER, PREFIX_CACHE, ROUTER, ActorCore, Address
from runtime.messages import ModelSpec
from runtime.supervision import RestartPolicy


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of one ``Runtime``. ``kv_budget_bytes`` None: derived from the memory MLX reports."""

    kv_budget_bytes: int | None = None
    kv_budget_fraction: float = 0.5
    reservation_timeout_s: float = 30.0
    default_max_tokens: int = 4096  # cap for requests that give no max_tokens
    router_mailbox_capacity: int = 1024
    engine_restart: RestartPolicy = RestartPolicy()
    coalesce: CoalescePolicy = CoalescePolicy()  # token events merged by size/age for hosts


Spawn = Callable[[Address, ActorCore], None]


def build_standing_actors(
    config: RuntimeConfig, load_backend: BackendLoader
) -> list[tuple[Address, ActorCore]]:
    """The router, KV keeper and prefix-cache manager; engines load with ``load_backend``."""
    if config.kv_budget_bytes is None:
        from runtime.memory import default_kv_budget_bytes

        budget = default_kv_budget_bytes(config.kv_budget_fraction)
    else:
        budget = config.kv_budget_bytes

    def engine_factory(spec: ModelSpec, epoch: int) -> ActorCore:
        return EngineCore(
            spec, epoch, load_backend, config.reservation_timeout_s, config.default_max_tokens
        )

    return [
        (KV_KEEPER, KVBudgetCore(budget, default_timeout_s=config.reservation_timeout_s)),
        (PREFIX_CACHE, PrefixCacheCore()),
        (ROUTER, RouterCore(engine_factory)),
    ]
