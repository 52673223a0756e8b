"""The disk tier from the command line: ``mlxrt serve`` and ``mlxrt chat`` keep their prefix
cache on disk by default (``--disk-cache DIR``, ``--disk-cache-mib N``, ``--no-disk-cache``),
and ``mlxrt cache`` shows or clears it (docs/cli.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from runtime.backends.disk import DiskCacheConfig, DiskStore, default_cache_dir
from runtime.backends.disk.config import DEFAULT_DISK_BUDGET_BYTES


def add_disk_flags(parser: argparse.ArgumentParser) -> None:
    """``--disk-cache DIR``, ``--disk-cache-mib N`` and ``--no-disk-cache``."""
    parser.add_argument(
        "--disk-cache", metavar="DIR", default=None,
        help=f"where the prefix cache keeps entries the KV budget evicts, across restarts "
        f"(default {default_cache_dir()})",
    )  # fmt: skip
    parser.add_argument(
        "--disk-cache-mib", metavar="N", type=int, default=DEFAULT_DISK_BUDGET_BYTES >> 20,
        help=f"most MiB its files may take, least recently used deleted first "
        f"(default {DEFAULT_DISK_BUDGET_BYTES >> 20})",
    )  # fmt: skip
    parser.add_argument(
        "--no-disk-cache", action="store_true", help="keep the prefix cache in memory only"
    )


def disk_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> DiskCacheConfig | None:
    """The disk tier the flags ask for (None: off); a negative budget is a usage error."""
    if args.no_disk_cache:
        return None
    if args.disk_cache_mib < 0:
        parser.error("--disk-cache-mib must be 0 or more")
    directory = args.disk_cache or str(default_cache_dir())
    return DiskCacheConfig(directory=directory, budget_bytes=args.disk_cache_mib << 20)


def disk_note(config: DiskCacheConfig | None) -> str:
    """The one line said at start: where the disk tier is, how large it may grow, how to stop it."""
    if config is None:
        return "prefix cache: in memory only"
    return (
        f"prefix cache on disk: {config.directory}, up to {config.budget_bytes >> 20} MiB "
        "(--no-disk-cache: memory only; `mlxrt cache clear` empties it)"
    )


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``mlxrt cache show|clear [--disk-cache DIR]``."""
    cache = commands.add_parser(
        "cache",
        help="show or clear the prefix cache kept on disk",
        description="Show or clear the prefix cache that `mlxrt serve` and `mlxrt chat` keep on "
        "disk (entries the KV budget evicted, and what was in memory at a clean exit).",
        epilog="examples:\n  mlxrt cache show\n  mlxrt cache clear\n"
        "  mlxrt cache clear --disk-cache ~/my-cache\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cache.set_defaults(run=run)
    cache.add_argument("action", choices=("show", "clear"))
    cache.add_argument(
        "--disk-cache", metavar="DIR", default=None,
        help=f"the folder (default {default_cache_dir()})",
    )  # fmt: skip


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Print what the folder holds, or delete every entry in it."""
    root = Path(args.disk_cache or default_cache_dir())
    files = sorted(root.glob("*/*.safetensors")) if root.is_dir() else []
    if args.action == "show":
        total = sum(f.stat().st_size for f in files)
        models = len({f.parent for f in files})
        print(f"{root}: {len(files)} entries, {total / 2**20:.1f} MiB, {models} model(s)")
        return 0
    deleted = DiskStore(root, "0" * 64, 0).clear()
    print(f"{root}: deleted {deleted} entries")
    return 0
