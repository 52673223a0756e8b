"""``mlxrt serve``: the OpenAI-compatible HTTP API on uvicorn (docs/http.md).

Before anything loads, the port is checked free (a taken port is one line, not a model load
then a uvicorn traceback). The models named on the command line stay loaded unless
``--keep-alive`` is given; models loaded on demand unload after ``DEFAULT_KEEP_ALIVE`` idle.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import socket
import sys
from typing import TYPE_CHECKING

import msgspec

from runtime.cli.cache import add_disk_flags, disk_config, disk_note
from runtime.cli.flags import (
    add_backend,
    add_ctx_size,
    add_draft_model,
    add_model,
    add_quiet,
    add_temperature,
    check_shared,
    model_options,
)
from runtime.cli.model_args import model_specs, prepare_specs
from runtime.cli.models import DEFAULT_KEEP_ALIVE, add_serve_flags
from runtime.cli.serve_flags import (
    add_cluster_flags,
    add_request_flags,
    check_request_flags,
    cluster_config,
)
from runtime.cli.serve_keys import add_key_flags, key_settings, warn_if_exposed
from runtime.errors import AddressInUse, ClusterUnavailable
from runtime.host.config import RuntimeConfig
from runtime.progress import tqdm_progress

if TYPE_CHECKING:
    import uvicorn

    from runtime.server import OpenAIServer

# On Ctrl-C open generations end at once (runtime/server/serving.py); connections still busy
# after this (a model load, a slow client) are cancelled.
GRACEFUL_SHUTDOWN_S = 10

_DESCRIPTION = """\
Serve models over an OpenAI-compatible HTTP API (docs/http.md): /v1/completions,
/v1/chat/completions, /v1/models, the runtime's own /v1/prewarm, /health and /metrics. The models
load before the server accepts requests; Ctrl-C (or SIGTERM) stops it: running streams end at
once with a last chunk saying so and [DONE], and it exits 0."""
_EXAMPLES = """examples:
  mlxrt serve                                  the default model on 127.0.0.1:8000
  mlxrt serve --model gemma3-270m --model chat=~/models/smol --port 8080
  mlxrt serve --model-option kv_bits=8 --kv-budget-mib 512 --host 0.0.0.0
  mlxrt serve --keep-alive 30m --no-auto-load  unload models idle 30 min; load none on demand
  mlxrt serve --host 0.0.0.0 --api-key-file keys.txt --max-concurrent-per-key 4
  mlxrt serve --ray --replicas 2                each model as 2 engine processes on a local Ray
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``serve`` to ``mlxrt``'s commands."""
    serve = commands.add_parser(
        "serve",
        help="serve models over an OpenAI-compatible HTTP API",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model(serve, many=True)
    serve.add_argument(
        "--model-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model option for every model, e.g. kv_bits=4 or context_length=8192 (docs/api.md)",
    )
    add_backend(serve, " (simulated: NAME only, no PATH)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    serve.add_argument(
        "--kv-budget-mib", type=int, help="KV cache budget (default: a fraction of MLX's memory)"
    )
    serve.add_argument(
        "--kv-budget-fraction",
        type=float,
        default=RuntimeConfig().kv_budget_fraction,
        help="share of the memory MLX reports for KV, without --kv-budget-mib (default 0.5)",
    )
    add_temperature(
        serve,
        "temperature of requests that send none (default 0: greedy, as mlx_lm.server; "
        "OpenAI's own default is 1.0, which a model this small turns into noise)",
    )
    add_ctx_size(serve)
    add_draft_model(serve)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_serve_flags(serve)
    add_key_flags(serve)
    add_request_flags(serve)
    add_cluster_flags(serve)
    add_quiet(serve, "progress bars")
    add_disk_flags(serve)
    serve.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``mlxrt serve``: 2 with one line for a port in use or a Ray head that does not answer,
    both found before any model loads."""
    try:
        return serve_models(args, parser)
    except (AddressInUse, ClusterUnavailable) as error:
        print(f"mlxrt serve: {error}", file=sys.stderr)
        return 2


def serve_models(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Load the models (fetched and converted first, with progress bars) and serve them until
    Ctrl-C or SIGTERM (then 0: open requests end properly, serving.py); 2 (a usage error) for a
    malformed --model, --model-option or --keep-alive. Raises ``AddressInUse`` before loading
    anything when the port cannot be listened on, ``ClusterUnavailable`` when no Ray head
    answers at ``--ray ADDRESS``."""
    from runtime.server import OpenAIServer, ServerConfig
    from runtime.server.models import parse_keep_alive
    from runtime.server.serving import serve

    check_shared(args, parser)
    check_request_flags(args, parser)
    try:
        # Named models stay loaded unless --keep-alive says otherwise; on-demand ones time out.
        named_s = None if args.keep_alive is None else parse_keep_alive(args.keep_alive)
        keep_alive_s = parse_keep_alive(args.keep_alive or DEFAULT_KEEP_ALIVE)
        models = model_specs(args.model, args.backend, model_options(args))
        access = key_settings(args)  # before any model loads: a bad key file is a usage error
    except ValueError as error:
        parser.error(str(error))
    check_port_free(args.host, args.port)
    if args.ray not in (None, "local", "auto"):  # a head that does not answer: one line, now
        from runtime.cluster.connect import check_reachable

        check_reachable(args.ray)
    warn_if_exposed(args.host, args.port, access)
    models = tuple(
        msgspec.structs.replace(spec, keep_alive_s=named_s, replicas=args.replicas)
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
        cluster=cluster_config(args, parser),
        disk_cache=disk_config(args, parser),
    )
    if not args.quiet:
        print(disk_note(runtime.disk_cache), file=sys.stderr, flush=True)
    config = ServerConfig(
        models=models,
        runtime=runtime,
        keep_alive_s=keep_alive_s,
        default_temperature=args.temperature,
        default_max_tokens=args.max_tokens,
        allowed_origins=tuple(args.allowed_origins),
        media_dirs=tuple(args.media_dir),
        fetch_images=args.fetch_images,
        # Known models and cached conversions: MLX's, or llama.cpp's where auto picks it.
        offer_cached_models=args.backend in ("mlx", "auto"),
        catalog_backend=args.backend,
        **access,
    )
    # Bars for what loads on demand too (fetch, convert, load), for as long as the server runs.
    with tqdm_progress(disable=args.quiet) as progress:
        server = OpenAIServer(config, progress=progress)
        serve(server, _uvicorn_config(server, args))
    return 0


def check_port_free(host: str, port: int) -> None:
    """Raise ``AddressInUse`` unless ``host``:``port`` can be listened on now (bound the way
    uvicorn binds it, with SO_REUSEADDR, then let go)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as error:  # socket.gaierror too: a host that is no address here
        reason = error.strerror or str(error)
        raise AddressInUse(
            f"cannot listen on {host}:{port} ({reason}); stop what holds it (another mlxrt "
            "serve?) or pick another --port"
        ) from None


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
