"""``mlxrt``: the command line. ``demo`` runs the demo, ``generate`` one prompt, ``chat`` an
interactive chat, ``serve`` the OpenAI-compatible HTTP API (docs/http.md); ``ps``, ``load``,
``unload`` and ``models`` manage a running server's models (runtime/cli/models.py); ``cache`` shows
or clears the disk tier. Each command is a module of this package that adds its parser and names
its ``run``; this one only puts them together. With no ``--model`` each uses the default model
(SmolLM2-135M-Instruct, fetched from PyPI and converted on first use, with a progress bar)."""

from __future__ import annotations

import argparse
import os
import sys

from runtime.cli import cache, chat, demo, generate, models, serve
from runtime.cli.flags import version_text

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
_DESCRIPTION = """\
The mlx-actor-runtime command line. With no --model each command uses the default model
(SmolLM2-135M-Instruct), fetched from PyPI and converted on first use, with a progress bar.
`mlxrt COMMAND --help` says more about each command."""


def build_parser() -> argparse.ArgumentParser:
    """``mlxrt``'s parser, every command's included."""
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
    demo.add_command(commands)
    generate.add_command(commands)
    chat.add_command(commands)
    serve.add_command(commands)
    models.add_commands(commands)  # ps, load, unload, models
    cache.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    # transformers (under mlx-lm) warns at import that PyTorch is missing: MLX needs no PyTorch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.run(args, parser)  # each command's parser names its module's run
    return code


if __name__ == "__main__":
    sys.exit(main())
