"""Configuration of a runtime: the knobs a host sets when it creates one."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from runtime.backends.disk.config import DiskCacheConfig
from runtime.cluster.options import ClusterConfig
from runtime.errors import InvalidConfig
from runtime.kernel.supervision import RestartPolicy
from runtime.text.coalesce import CoalescePolicy


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of one ``Runtime``. ``kv_budget_bytes`` None: derived from the memory MLX reports."""

    kv_budget_bytes: int | None = None
    kv_budget_fraction: float = 0.5
    reservation_timeout_s: float = 30.0
    default_max_tokens: int = 4096  # cap for requests that give no max_tokens
    # A max_tokens past the room the prompt leaves in the context is lowered to that room (the
    # reply may end "length" there, and its usage says so); True: refused (context_length_exceeded).
    strict_max_tokens: bool = False
    # A stream with no token for this long after its first ends Failed(stream_stalled); None: off.
    stall_timeout_s: float | None = 60.0
    router_mailbox_capacity: int = 1024
    # Per model: crashes (or stuck steps) recovered by reloading it; beyond, it is marked failed.
    engine_restart: RestartPolicy = RestartPolicy()
    # A compute step running longer is a stuck engine (docs/api.md); it must exceed the longest
    # legitimate step. Loads are not watched. None (or 0): no watchdog.
    step_timeout_s: float | None = 60.0
    coalesce: CoalescePolicy = CoalescePolicy()  # token events merged by size/age for hosts
    # A request for a model still loading, or unloaded by its keep-alive (ModelSpec.keep_alive_s),
    # waits for the model (loading it again); False: such a request is refused (model_not_loaded).
    auto_load: bool = True
    # Engines as Ray actors, each in a process of its own (docs/cluster.md); None: in this process.
    cluster: ClusterConfig | None = None
    # The prefix cache's disk tier: evicted entries are written there and outlive the process
    # (docs/design.md, "The disk tier"); None: off (`mlxrt serve` and `mlxrt chat` turn it on).
    disk_cache: DiskCacheConfig | None = None

    def __post_init__(self) -> None:
        # A zero mailbox or a negative timeout would not fail here but hang or misfire later.
        for name, value, ok, wanted in (
            ("kv_budget_bytes", self.kv_budget_bytes, _at_least(0), ">= 0, or None"),
            ("kv_budget_fraction", self.kv_budget_fraction, _fraction, "in (0, 1]"),
            ("reservation_timeout_s", self.reservation_timeout_s, _at_least(0), ">= 0"),
            ("default_max_tokens", self.default_max_tokens, _at_least(1), ">= 1"),
            ("stall_timeout_s", self.stall_timeout_s, _positive, "> 0, or None (off)"),
            ("router_mailbox_capacity", self.router_mailbox_capacity, _at_least(1), ">= 1"),
            ("step_timeout_s", self.step_timeout_s, _at_least(0), ">= 0, or None (off)"),
        ):
            if value is not None and not ok(value):
                raise InvalidConfig(f"RuntimeConfig.{name} must be {wanted} (got {value!r})")

    def resolved_kv_budget_bytes(self) -> int:
        """``kv_budget_bytes``, or ``kv_budget_fraction`` of the memory MLX can still allocate."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        from runtime.backends.mlx.memory import default_kv_budget_bytes  # imports MLX: only here

        return default_kv_budget_bytes(self.kv_budget_fraction)


def _at_least(low: float) -> Callable[[float], bool]:
    return lambda value: value >= low


def _positive(value: float) -> bool:
    return value > 0


def _fraction(value: float) -> bool:
    return 0 < value <= 1
