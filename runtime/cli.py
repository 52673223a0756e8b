"""``mlxrt``: the command line. ``demo`` runs the demo, ``generate`` one prompt, ``serve`` the
OpenAI-compatible HTTP API (docs/http.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys

import anyio

from runtime.api import Runtime
from runtime.config import RuntimeConfig
from runtime.messages import ModelSpec, TokensEmitted

GRACEFUL_SHUTDOWN_S = 10  # on Ctrl-C, streams still running after this are cancelled


async def _generate(args: argparse.Namespace) -> int:
    async with Runtime() as rt:
        await rt.load_model(ModelSpec(name="model", path=args.model, backend=args.backend))
        async with rt.generate("model", args.prompt, max_tokens=args.max_tokens) as stream:
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def model_specs(values: list[str], backend: str, options: list[str]) -> tuple[ModelSpec, ...]:
    """``NAME=PATH`` arguments as specs (a simulated model needs only ``NAME``); ``KEY=VALUE``
    options go to every model, their values read as JSON when they parse (``kv_bits=4``).

    Raises ``ValueError`` with a sentence for a malformed option or a malformed or repeated name.
    """
    parsed: dict[str, str | int | float | bool | None] = {}
    for option in options:
        key, equals, text = option.partition("=")
        if not key or not equals:
            raise ValueError(f"--model-option {option!r}: write KEY=VALUE")
        try:
            parsed[key] = json.loads(text)
        except json.JSONDecodeError:
            parsed[key] = text
    specs: list[ModelSpec] = []
    for value in values:
        name, _, path = value.partition("=")
        if not name or (backend == "mlx" and not path):
            raise ValueError(f"--model {value!r}: write NAME=PATH (an mlx-lm model directory)")
        if any(spec.name == name for spec in specs):
            raise ValueError(f"--model {name!r} is given twice; each model needs its own name")
        specs.append(ModelSpec(name=name, path=path or None, backend=backend, options=parsed))
    return tuple(specs)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from runtime.server import OpenAIServer, ServerConfig

    try:
        models = model_specs(args.model, args.backend, args.model_option)
    except ValueError as error:
        parser.error(str(error))
    # uvicorn configures its own loggers only; the runtime's (model loads, reuse paths) go here.
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(name)s: %(message)s")
    budget = None if args.kv_budget_mib is None else args.kv_budget_mib << 20
    runtime = RuntimeConfig(kv_budget_bytes=budget, kv_budget_fraction=args.kv_budget_fraction)
    server = OpenAIServer(ServerConfig(models=models, runtime=runtime))
    config = uvicorn.Config(
        server.app,
        host=args.host,
        port=args.port,
        # uvloop when installed: the event loop only moves messages, so its speed is latency.
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    uvicorn.Server(config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlxrt", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="show the runtime on a simulated and a tiny model")
    gen = commands.add_parser("generate", help="generate from one prompt")
    gen.add_argument("--model", required=True, help="an mlx-lm model directory")
    gen.add_argument("--backend", default="mlx", choices=["mlx", "simulated"])
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=128)
    serve = commands.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a model to load, served under NAME (repeat for several)",
    )
    serve.add_argument(
        "--model-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model option for every model, e.g. kv_bits=4 or context_length=8192 (docs/api.md)",
    )
    serve.add_argument("--backend", default="mlx", choices=["mlx", "simulated"])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--kv-budget-mib", type=int, help="KV cache budget (default: a fraction of MLX's memory)"
    )
    serve.add_argument(
        "--kv-budget-fraction",
        type=float,
        default=RuntimeConfig().kv_budget_fraction,
        help="share of the memory MLX reports for KV, without --kv-budget-mib (default 0.5)",
    )
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from runtime.demo import main as demo

        demo()
        return 0
    if args.command == "serve":
        return _serve(args, parser)
    return anyio.run(_generate, args, backend_options={"use_uvloop": True})


if __name__ == "__main__":
    sys.exit(main())
