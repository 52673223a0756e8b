"""Where the disk tier keeps its files and how many bytes it may use."""

from __future__ import annotations

from pathlib import Path

import msgspec

from runtime.errors import InvalidConfig

DEFAULT_DISK_BUDGET_BYTES = 4 << 30  # a modest default: a few dozen long prompts of a small model


def default_cache_dir() -> Path:
    """The runtime's cache folder's ``prefix-cache`` (``$MLXRT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/mlx-actor-runtime``, else ``~/.cache/mlx-actor-runtime``)."""
    from runtime.backends.model_store import cache_root

    return cache_root() / "prefix-cache"


class DiskCacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The disk tier of the prefix cache (``RuntimeConfig.disk_cache``; None there: off).

    ``directory``: where entry files go, one folder per model fingerprint; ``budget_bytes``: the
    most all of its files may take (least recently used go first); ``shutdown_s``: how long a
    clean unload may spend writing the entries still in RAM.
    """

    directory: str
    budget_bytes: int = DEFAULT_DISK_BUDGET_BYTES
    shutdown_s: float = 10.0

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise InvalidConfig(
                f"DiskCacheConfig.budget_bytes must be >= 0 (got {self.budget_bytes})"
            )
        if self.shutdown_s < 0:
            raise InvalidConfig(f"DiskCacheConfig.shutdown_s must be >= 0 (got {self.shutdown_s})")
        if not self.directory:
            raise InvalidConfig("DiskCacheConfig.directory must name a folder")
