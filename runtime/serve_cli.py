"""``mlxrt serve``: the OpenAI-compatible HTTP API on uvicorn (docs/http.md)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
from typing import TYPE_CHECKING

import msgspec

from runtime.config import RuntimeConfig
from runtime.model_args import model_specs, prepare_specs
from runtime.progress import tqdm_progress
from runtime.serve_flags import check_request_flags

if TYPE_CHECKING:
    import uvicorn

    from runtime.server import OpenAIServer

# On Ctrl-C open generations end at once (runtime/server/serving.py); connections still busy
# after this (a model load, a slow client) are cancelled.
GRACEFUL_SHUTDOWN_S = 10


def serve_models(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Load the models (fetched and converted first, with progress bars) and serve them until
    Ctrl-C or SIGTERM (then 0: open requests end properly, serving.py); 2 (a usage error) for a
    malformed --model, --model-option or --keep-alive."""
    from runtime.server import OpenAIServer, ServerConfig
    from runtime.server.models import parse_keep_alive
    from runtime.server.serving import serve

    check_request_flags(args, parser)
    try:
        keep_alive_s = parse_keep_alive(args.keep_alive)
        models = model_specs(args.model, args.backend, args.model_option)
    except ValueError as error:
        parser.error(str(error))
    models = tuple(
        msgspec.structs.replace(spec, keep_alive_s=keep_alive_s)
        for spec in prepare_specs(models, quiet=args.quiet)
    )
    # uvicorn configures its own loggers only; the runtime's (model loads, reuse paths) go here.
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    budget = None if args.kv_budget_mib is None else args.kv_budget_mib << 20
    runtime = RuntimeConfig(
        kv_budget_bytes=budget,
        kv_budget_fraction=args.kv_budget_fraction,
        auto_load=not args.no_auto_load,
        strict_max_tokens=args.strict_max_tokens,
    )
    config = ServerConfig(
        models=models,
        runtime=runtime,
        keep_alive_s=keep_alive_s,
        default_temperature=args.temp,
        default_max_tokens=args.max_tokens,
        allowed_origins=tuple(args.allowed_origins),
        offer_cached_models=args.backend == "mlx",  # cached models are MLX ones
    )
    # Bars for what loads on demand too (fetch, convert, load), for as long as the server runs.
    with tqdm_progress(disable=args.quiet) as progress:
        server = OpenAIServer(config, progress=progress)
        serve(server, _uvicorn_config(server, args))
    return 0


def _uvicorn_config(server: OpenAIServer, args: argparse.Namespace) -> uvicorn.Config:
    import uvicorn

    return uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        # uvloop when installed: the event loop only moves messages, so its speed is latency.
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
