"""``mlxrt ps``, ``load``, ``unload`` (talking to a running ``mlxrt serve``) and ``models``
(what this machine can load, read from the cache). The client is the standard library's: the
commands need no test dependency."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from runtime.backends.model_source import available_models
from runtime.cli.serve_keys import API_KEY_ENV

DEFAULT_KEEP_ALIVE = (
    "5m"  # for models `mlxrt serve` loads on demand, without --keep-alive (Ollama's)
)
DEFAULT_URL = "http://127.0.0.1:8000"  # where `mlxrt serve` listens by default
LOAD_TIMEOUT_S = 3600.0  # a first load may fetch and convert the model
TIMEOUT_S = 60.0  # an unload waits for the model's requests to drain
RUNTIME_STATES = ("preparing", "loading", "loaded", "unloading", "restarting", "failed", "idle")


class ServerError(Exception):
    """The server answered with an error, or could not be reached; the message says what."""


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``ps``, ``load``, ``unload`` and ``models`` to ``mlxrt``'s sub-commands."""
    url_help = f"the server's address (default {DEFAULT_URL})"

    def command(name: str, summary: str, examples: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(
            name,
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog=f"examples:\n{examples}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.set_defaults(run=run)
        return parser

    ps = command(
        "ps",
        "the models a running server has, and their state",
        "  mlxrt ps                                the server on :8000\n"
        "  mlxrt ps --url http://127.0.0.1:8080\n",
    )
    ps.add_argument("--url", default=DEFAULT_URL, help=url_help)
    load = command(
        "load",
        "load a model on a running server",
        "  mlxrt load gemma3-270m                  fetched and converted first if needed\n"
        "  mlxrt load gemma3-270m --keep-alive -1  and kept loaded\n",
    )
    load.add_argument("name", metavar="NAME", help="a model `mlxrt ps` or `mlxrt models` lists")
    load.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help='unload it once idle this long ("30s", "5m", "1h"; -1: never); default: the '
        "server's --keep-alive",
    )
    load.add_argument("--url", default=DEFAULT_URL, help=url_help)
    unload = command(
        "unload",
        "unload a model from a running server",
        "  mlxrt unload gemma3-270m                its requests end, its memory is freed\n",
    )
    unload.add_argument("name", metavar="NAME")
    unload.add_argument("--url", default=DEFAULT_URL, help=url_help)
    command(
        "models",
        "the known and converted models this machine can load",
        "  mlxrt models                            name, source, cache state, description\n",
    )


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """``mlxrt serve``'s model-management flags: ``--keep-alive`` and ``--no-auto-load``."""
    serve.add_argument(
        "--keep-alive",
        metavar="DURATION",
        help='unload a model once idle this long ("30s", "5m", "1h"; -1: never). Default: the '
        f"models named by --model (or the default model) stay loaded; models loaded on demand "
        f"unload after {DEFAULT_KEEP_ALIVE}. Given, it applies to every model",
    )
    serve.add_argument(
        "--no-auto-load",
        action="store_true",
        help="refuse requests for a model that is not loaded (default: load it first)",
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """Run ``ps``, ``load``, ``unload`` or ``models``; 1 on an error the server reported, 2 when
    it cannot be reached."""
    try:
        match args.command:
            case "ps":
                print(_ps_table(_request(args.url, "GET", "/v1/models")["data"]))
            case "load":
                body: dict[str, Any] = {"model": args.name}
                if args.keep_alive is not None:
                    body["keep_alive"] = args.keep_alive
                started = time.monotonic()
                loaded = _request(args.url, "POST", "/v1/models/load", body, LOAD_TIMEOUT_S)
                took = time.monotonic() - started
                print(
                    f"loaded {loaded['model']} in {took:.1f} s (context {loaded['context_length']} "
                    f"tokens, keep-alive {_seconds(loaded['keep_alive'])})"
                )
            case "unload":
                _request(args.url, "POST", "/v1/models/unload", {"model": args.name})
                print(f"unloaded {args.name}")
            case "models":
                print(_models_table())
    except ServerError as error:
        print(f"mlxrt {args.command}: {error}", file=sys.stderr)
        return 2 if isinstance(error.__cause__, urllib.error.URLError) else 1
    return 0


def _request(
    url: str, method: str, path: str, body: object = None, timeout: float = TIMEOUT_S
) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    key = os.environ.get(API_KEY_ENV, "").strip()
    if key:  # a server started with keys answers only requests that send one
        headers["authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, method=method, headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:
        try:
            message = json.load(error)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {error.code} {error.reason}"
        if error.code == 401:
            message += f" (mlxrt sends the key set in ${API_KEY_ENV})"
        raise ServerError(message) from None
    except urllib.error.URLError as error:
        raise ServerError(
            f"no server answers at {url} ({error.reason}); start one with `mlxrt serve` or "
            "give its address with --url"
        ) from error


def _ps_table(cards: list[dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [
        ("NAME", "STATE", "REQUESTS", "KEEP-ALIVE", "UNLOADS IN", "WHERE", "DISK CACHE")
    ]
    now = time.time()
    # A model with replicas: one line per replica (each has its own state, requests and place).
    for card in [replica for model in cards for replica in model.get("replicas") or [model]]:
        if card.get("state") not in RUNTIME_STATES:
            continue  # available, not loaded: `mlxrt models` lists those
        expires_at = card.get("expires_at")
        until = "-" if expires_at is None else _seconds(max(expires_at - now, 0))
        keep_alive = _seconds(card.get("keep_alive"))
        where = card.get("placement") or "in process"  # a Ray engine: its node and pid
        requests = str(card.get("live_requests", 0))
        rows.append((card["id"], card["state"], requests, keep_alive, until, where, _disk(card)))
    return _table(rows) if len(rows) > 1 else "no model is loaded"


def _disk(card: dict[str, Any]) -> str:
    disk = card.get("disk_cache")
    if not disk:
        return "off"
    return (
        f"{disk['entries']} entries {disk['bytes'] / 2**20:.1f} MiB, {disk['hits']} hits "
        f"{disk['load_ms']} ms"
    )


def _models_table() -> str:
    rows: list[tuple[str, ...]] = [("NAME", "SOURCE", "CACHE", "DESCRIPTION")]
    for model in available_models():
        rows.append((model.name, model.source, model.cache.replace("_", " "), model.description))
    return _table(rows)


def _seconds(value: float | None) -> str:
    if value is None:
        return "forever"
    if value >= 3600:
        return f"{value / 3600:g}h"
    return f"{value / 60:g}m" if value >= 60 and value % 60 == 0 else f"{value:.0f}s"


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
