"""Flags and helpers ``mlxrt generate``, ``chat`` and ``serve`` share, so each is spelled once:
``--model``, ``--backend``, ``--max-tokens``, ``--quiet``, ``--temp``/``--temperature``,
``--ctx-size``, ``--draft-model``, ``--raw``/``--chat``, a prompt read from stdin, and the tok/s
line (docs/cli.md)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Literal

from runtime.backends.model_store import DEFAULT_MODEL, KNOWN_MODELS
from runtime.blas import blas_in_use

Framing = Literal["auto", "chat", "raw"]
BACKEND_CHOICES = ["mlx", "llamacpp", "auto", "simulated"]
_BACKEND_HELP = (
    "auto (the default: llama.cpp for a GGUF file or known model on a CPU where llama-cpp-python "
    "is installed, else MLX), mlx, llamacpp (a .gguf file or known model on llama.cpp's "
    "kernels), "
    "or simulated: a deterministic stand-in model (gibberish), no MLX needed"
)


def add_model(
    parser: argparse.ArgumentParser, *, many: bool = False, default: str | None = None
) -> None:
    """``--model [NAME=]PATH``: the one model a command runs, or with ``many`` (serve) a model to
    load, repeatable."""
    if many:
        parser.add_argument(
            "--model", action="append", default=[], metavar="[NAME=]PATH",
            help="a model to load (repeat for several): an mlx-lm directory, a .gguf file or a "
            "known model, served under NAME or a name derived from PATH; default "
            f"{DEFAULT_MODEL}",
        )  # fmt: skip
        return
    parser.add_argument(
        "--model", default=default, metavar="[NAME=]PATH",
        help=f"an mlx-lm directory, a .gguf file or a known model ({', '.join(KNOWN_MODELS)}), "
        f"named NAME or after the file or directory; default {DEFAULT_MODEL}",
    )  # fmt: skip


def add_backend(parser: argparse.ArgumentParser, note: str = "") -> None:
    """``--backend``: which kind of backend runs the model (``auto`` by default)."""
    parser.add_argument(
        "--backend", default="auto", choices=BACKEND_CHOICES, help=_BACKEND_HELP + note
    )


def add_max_tokens(parser: argparse.ArgumentParser, default: int, per: str) -> None:
    """``--max-tokens N`` of generate and chat (serve's own: serve_flags.py)."""
    parser.add_argument(
        "--max-tokens", type=int, default=default, metavar="N",
        help=f"most tokens {per} ({default})",
    )  # fmt: skip


def add_quiet(parser: argparse.ArgumentParser, what: str) -> None:
    """``--quiet``: ``what`` is left out (progress bars at least)."""
    parser.add_argument("--quiet", action="store_true", help=f"no {what}")


def add_temperature(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--temp`` and ``--temperature``: one flag, two names (llama.cpp's and OpenAI's)."""
    parser.add_argument(
        "--temp", "--temperature", dest="temperature", type=float, default=0.0, metavar="T",
        help=help_text,
    )  # fmt: skip


def add_ctx_size(parser: argparse.ArgumentParser) -> None:
    """``-c``/``--ctx-size``: the context length, as llama.cpp spells it (the model option
    ``context_length``)."""
    parser.add_argument(
        "-c", "--ctx-size", dest="ctx_size", type=int, metavar="N",
        help="context length in tokens (default: the model's own); the model option "
        "context_length",
    )  # fmt: skip


def add_draft_model(parser: argparse.ArgumentParser) -> None:
    """``--draft-model``: a second model that drafts for speculative decoding, as llama.cpp and
    mlx-lm spell it (the model option ``draft_model``)."""
    parser.add_argument(
        "--draft-model", dest="draft_model", metavar="MODEL",
        help="a smaller model with the same vocabulary whose tokens are the speculative drafts "
        "(a path or a known name; how many per pass: the model option speculative); the model "
        "option draft_model",
    )  # fmt: skip


def add_framing(parser: argparse.ArgumentParser) -> None:
    """``--raw`` / ``--chat``: how the text reaches the model; by default raw only for a model
    without a chat template (it would otherwise get a made-up ``user:``/``assistant:`` frame)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--raw", dest="framing", action="store_const", const="raw", default="auto",
        help="send the text as is, no chat template (the default for a model that has none)",
    )  # fmt: skip
    group.add_argument(
        "--chat", dest="framing", action="store_const", const="chat",
        help="frame the text as chat messages even for a model without a chat template (the "
        "plain 'user: ...' fallback format)",
    )  # fmt: skip


def check_shared(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """A usage error (exit 2) for a negative temperature or a context length below 1."""
    if args.temperature < 0:
        parser.error("--temp must be 0 (greedy) or more")
    if args.ctx_size is not None and args.ctx_size < 1:
        parser.error("--ctx-size must be at least 1 token")


def model_options(args: argparse.Namespace) -> list[str]:
    """The ``KEY=VALUE`` model options the flags ask for, after any ``--model-option``."""
    given: list[str] = list(getattr(args, "model_option", []))
    if args.ctx_size is not None:
        given.append(f"context_length={args.ctx_size}")
    if getattr(args, "draft_model", None) is not None:
        given.append(f"draft_model={args.draft_model}")
    return given


def framed_raw(framing: Framing, chat_template: bool) -> bool:
    """Whether the text goes to the model raw: asked for, or auto on a model without a template."""
    return framing == "raw" or (framing == "auto" and not chat_template)


def raw_note(model: str, command: str) -> str:
    """The one line that says a model without a chat template gets raw text, and the way out."""
    return (
        f"{model} has no chat template: the text goes to it as is (a raw completion); "
        f"`mlxrt {command} --chat` frames it as chat anyway"
    )


def read_prompt(value: str | None) -> str | None:
    """The prompt a flag gives; ``-`` reads it from stdin (one trailing newline dropped). Raises
    ``ValueError`` when stdin holds nothing."""
    if value != "-":
        return value
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise ValueError("the prompt was to come from stdin (-), but stdin was empty")
    return text


@dataclass(frozen=True, slots=True)
class Speed:
    """One reply's timing: the prompt (until the first token) and the tokens after it."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prompt_s: float
    decode_s: float

    def line(self) -> str:
        """``prompt 14 tokens (0 cached) 0.21 s, 64 tokens 2.05 s, 30.7 tok/s``."""
        rate = (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0
        return (
            f"prompt {self.prompt_tokens} tokens ({self.cached_tokens} cached) "
            f"{self.prompt_s:.2f} s, {self.completion_tokens} tokens {self.decode_s:.2f} s, "
            f"{rate:.1f} tok/s"
        )


def version_text() -> str:
    """``mlxrt --version``: the package, MLX and the BLAS MLX would call here."""

    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"mlxrt {version('mlx-actor-runtime')} (mlx {version('mlx')}, mlx-lm {version('mlx-lm')}; "
        f"BLAS: {blas_in_use()})"
    )
