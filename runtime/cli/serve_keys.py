"""``mlxrt serve``'s access flags: API keys, who reads ``/metrics``, limits per key, and the one
warning a server open to the network without a key prints (docs/http.md "Security").

The server side is runtime/server/gate.py; this module only turns flags and the environment
into ``ServerConfig`` fields. ``MLXRT_API_KEY`` is also what ``mlxrt ps/load/unload`` send.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any

API_KEY_ENV = "MLXRT_API_KEY"  # serve's key when no flag gives one; the client commands' key


def add_key_flags(serve: argparse.ArgumentParser) -> None:
    """Add the access flags to ``mlxrt serve``."""
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="answer only requests that send this key (repeat for several; each key's cached "
        f"prompts are its own); other local users can read it in `ps`: prefer ${API_KEY_ENV} "
        "or --api-key-file",
    )
    serve.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="keys, one a line ('#' starts a comment); with --api-key, both files' and flags' "
        "keys are accepted",
    )
    serve.add_argument(
        "--metrics-key",
        action="append",
        default=[],
        metavar="KEY",
        help="the only keys that may read /metrics (a scraper's); default: any API key",
    )
    serve.add_argument(
        "--public-metrics",
        action="store_true",
        help="/metrics answers without a key (on a private network's scraper)",
    )
    serve.add_argument(
        "--max-concurrent-per-key",
        type=int,
        metavar="N",
        help="at most N requests of one key run at once (without keys: of all clients); "
        "default: no limit",
    )
    serve.add_argument(
        "--max-queued-per-key",
        type=int,
        default=0,
        metavar="N",
        help="and N more wait for one of them to end; beyond, 429 (default 0)",
    )


def key_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerConfig`` fields the access flags give; raises ``InvalidConfig`` for a key file
    that cannot be read, a bad key or a limit out of range (the message says which)."""
    from runtime.errors import InvalidConfig
    from runtime.server.allowance import PerKeyLimits
    from runtime.server.auth import ApiKeys, read_key_file

    keys: list[str] = list(args.api_key)
    for path in args.api_key_file:
        keys += read_key_file(path)
    sources = "--api-key and --api-key-file"
    if not keys and os.environ.get(API_KEY_ENV):
        keys, sources = [os.environ[API_KEY_ENV].strip()], f"${API_KEY_ENV}"
    if args.max_concurrent_per_key is not None:
        PerKeyLimits(args.max_concurrent_per_key, args.max_queued_per_key)  # checked here
    elif args.max_queued_per_key:
        raise InvalidConfig("--max-queued-per-key needs --max-concurrent-per-key: set both")
    return {
        "api_keys": ApiKeys(keys, source=sources) if keys else None,
        "metrics_keys": ApiKeys(args.metrics_key, source="--metrics-key")
        if args.metrics_key
        else None,
        "public_metrics": args.public_metrics,
        "max_concurrent_per_key": args.max_concurrent_per_key,
        "max_queued_per_key": args.max_queued_per_key,
    }


def warn_if_exposed(host: str, port: int, settings: dict[str, Any]) -> None:
    """One line on stderr when the server listens beyond this machine and takes no key."""
    if settings["api_keys"] is None and not _loopback(host):
        print(
            f"mlxrt serve: warning: listening on {host}:{port} without an API key: anyone who "
            "can reach this port can use the server; give --api-key-file, --api-key or "
            f"${API_KEY_ENV}",
            file=sys.stderr,
            flush=True,
        )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
