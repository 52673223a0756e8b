"""Configuration of a runtime: the knobs a host sets when it creates one."""

from __future__ import annotations

import msgspec

from runtime.kernel.supervision import RestartPolicy
from runtime.text.coalesce import CoalescePolicy


class RuntimeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Knobs of one ``Runtime``. ``kv_budget_bytes`` None: derived from the memory MLX reports."""

    kv_budget_bytes: int | None = None
    kv_budget_fraction: float = 0.5
    reservation_timeout_s: float = 30.0
    default_max_tokens: int = 4096  # cap for requests that give no max_tokens
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

    def resolved_kv_budget_bytes(self) -> int:
        """``kv_budget_bytes``, or ``kv_budget_fraction`` of the memory MLX can still allocate."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        from runtime.backends.mlx.memory import default_kv_budget_bytes  # imports MLX: only here

        return default_kv_budget_bytes(self.kv_budget_fraction)
