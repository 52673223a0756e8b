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
    router_mailbox_capacity: int = 1024
    # An engine may crash (or overrun step_timeout_s) this often and be restarted, its model
    # reloaded; beyond it the model is marked failed until it is loaded again.
    engine_restart: RestartPolicy = RestartPolicy()
    # A compute step (a prefill chunk, a decode or batch step, tokenizing) running longer than
    # this is taken for a stuck engine: its requests fail (step_timeout) and the model reloads.
    # It must exceed the longest legitimate step (the first, unmeasured prefill chunk of the
    # slowest model). None: no watchdog. Loading and closing a model are not watched.
    step_timeout_s: float | None = 60.0
    coalesce: CoalescePolicy = CoalescePolicy()  # token events merged by size/age for hosts

    def resolved_kv_budget_bytes(self) -> int:
        """``kv_budget_bytes``, or ``kv_budget_fraction`` of the memory MLX can still allocate."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        from runtime.backends.mlx.memory import default_kv_budget_bytes  # imports MLX: only here

        return default_kv_budget_bytes(self.kv_budget_fraction)
