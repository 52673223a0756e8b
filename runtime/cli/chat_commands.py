"""What a line typed into ``mlxrt chat`` means: a ``/command`` or a message to the model
(docs/cli.md, "The interactive chat"). Pure parsing: runtime/cli/chat_session.py acts on the
result."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

HELP: Final = (
    "commands: /help, /reset (new conversation), /system TEXT (set instructions), "
    "/stats (the last reply's speed), /exit"
)


@dataclass(frozen=True, slots=True)
class Help:
    """``/help`` (or ``/?``): list the commands."""


@dataclass(frozen=True, slots=True)
class Reset:
    """``/reset``: a new conversation (the instructions stay)."""


@dataclass(frozen=True, slots=True)
class SetSystem:
    """``/system TEXT``: new instructions; ``/system`` alone clears them."""

    text: str | None


@dataclass(frozen=True, slots=True)
class Stats:
    """``/stats``: the last reply's prompt tokens (cached), tokens and tok/s."""


@dataclass(frozen=True, slots=True)
class Exit:
    """``/exit`` (or ``/quit``)."""


@dataclass(frozen=True, slots=True)
class Unknown:
    """A ``/word`` that is no command."""

    name: str


@dataclass(frozen=True, slots=True)
class Say:
    """Anything else: a message to the model."""

    text: str


Command = Help | Reset | SetSystem | Stats | Exit | Unknown | Say


def parse_line(line: str) -> Command | None:
    """The command a typed line means; None for a blank line."""
    text = line.strip()
    if not text:
        return None
    if not text.startswith("/"):
        return Say(text)
    name, _, rest = text.partition(" ")
    match name:
        case "/help" | "/?":
            return Help()
        case "/reset":
            return Reset()
        case "/system":
            return SetSystem(rest.strip() or None)
        case "/stats":
            return Stats()
        case "/exit" | "/quit":
            return Exit()
        case _:
            return Unknown(name)
