"""How much memory the runtime may plan to use, as MLX sees it."""

from __future__ import annotations

import os

# Checked in order: the GPU's recommended working set beats raw unified-memory size on Apple.
_DEVICE_MEMORY_KEYS = ("max_recommended_working_set_size", "memory_size")


def default_kv_budget_bytes(fraction: float = 0.5) -> int:
    """Return ``fraction`` of the memory MLX can still allocate, as a default KV budget.

    MLX is asked rather than the OS because MLX's allocator is what KV arrays come from: on Apple
    silicon the Metal working-set limit (``device_info()``) is lower than physical RAM, and on
    Linux CPU ``get_memory_limit()`` is MLX's own cap. Memory already active (weights loaded so
    far) is subtracted. Physical RAM (``os.sysconf``) is used only if MLX reports nothing.
    Raises ``ValueError`` unless ``0 < fraction <= 1``.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    # Lazily: importing the runtime imports no MLX (see "What imports MLX" in docs/design.md).
    import mlx.core as mx

    limit = _device_memory_bytes(mx) or int(mx.get_memory_limit())
    if limit <= 0:
        limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    available = max(limit - int(mx.get_active_memory()), 0)
    return int(available * fraction)


def _device_memory_bytes(mx: object) -> int:
    device_info = getattr(mx, "device_info", None)
    info = device_info() if callable(device_info) else {}
    for key in _DEVICE_MEMORY_KEYS:
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0
