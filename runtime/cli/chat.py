"""``mlxrt chat``: its flags, and the entry that loads the model and hands the terminal to the chat
session (chat_session.py), imported only when a chat starts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runtime.cli.cache import add_disk_flags, disk_config, disk_note
from runtime.cli.flags import (
    add_backend,
    add_ctx_size,
    add_draft_model,
    add_framing,
    add_max_tokens,
    add_model,
    add_quiet,
    add_temperature,
    check_shared,
    model_options,
)
from runtime.cli.model_args import model_specs, prepare_specs
from runtime.errors import MlxRuntimeError

_DESCRIPTION = """\
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
_EXAMPLES = """examples:
  mlxrt chat                                   the default model
  mlxrt chat --show-cache                      print `cached n/m` after each reply
  mlxrt chat --resume --show-cache             go on with the last chat: `cached n/m from disk`
  mlxrt chat --stats --temp 0.7 --ctx-size 4096  the speed after each reply
  mlxrt chat --model gemma3-270m               a known model
  mlxrt chat --model ~/models/llama.Q4_0.gguf --system "You are terse." --max-tokens 512
  mlxrt chat --model smol=~/models/smol-mlx    an mlx-lm directory, named smol
"""


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``chat`` to ``mlxrt``'s commands."""
    chat = commands.add_parser(
        "chat",
        help="chat with a model in the terminal",
        description=_DESCRIPTION,
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model(chat)
    add_backend(chat)
    chat.add_argument("--system", metavar="TEXT", help="instructions for the whole chat")
    add_max_tokens(chat, 256, "per reply")
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
    add_quiet(chat, "progress bars or load notes")
    add_disk_flags(chat)
    chat.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``mlxrt chat``: 2 for a model that cannot be fetched or loaded, 130 for Ctrl-C while it
    loads."""
    try:
        return _chat(args, parser)
    except (ValueError, MlxRuntimeError) as error:
        print(f"mlxrt chat: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from runtime.cli.chat_history import history_path
    from runtime.cli.chat_session import ChatSettings, run_chat

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
