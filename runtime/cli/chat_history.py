"""``mlxrt chat``'s conversation kept on disk, so ``mlxrt chat --resume`` goes on where the last
chat with the same model stopped. With the prefix cache's disk tier (on by default for ``chat``)
the resumed conversation's next turn then reuses the KV the last run left: it answers at warm
speed (``--show-cache`` says ``from disk``).

One JSON file per model name under the runtime's cache folder, written after each reply (a
temporary file, then a rename: a chat killed mid-write leaves the previous version). A file that
cannot be read is reported and ignored: the chat starts afresh.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from runtime.backends.model_store import cache_root
from runtime.messages import ChatMessage

FORMAT = 1


class SavedChat(msgspec.Struct, frozen=True, kw_only=True):
    """What a chat resumes: its instructions and its turns."""

    format: int = FORMAT
    system: str | None = None
    turns: tuple[ChatMessage, ...] = ()


def history_path(model: str, folder: Path | None = None) -> Path:
    """Where the chat with ``model`` is kept (the name made safe as a file name)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model) or "model"
    return (folder or cache_root() / "chats") / f"{safe}.json"


def save(path: Path, chat: SavedChat) -> None:
    """Write ``chat`` to ``path`` atomically (the folder is made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(msgspec.json.encode(chat))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def load(path: Path) -> SavedChat | None:
    """The chat kept at ``path``; None when there is none. Raises ``ValueError`` saying why a
    file that is there cannot be used."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        chat = msgspec.json.decode(data, type=SavedChat)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not a saved chat ({exc})") from exc
    if chat.format != FORMAT:
        raise ValueError(f"{path} was written by another version (format {chat.format})")
    return chat


def resume(path: Path | None) -> tuple[SavedChat | None, str]:
    """The chat to go on with (None: none) and the line that tells the user what happened."""
    if path is None:
        return None, "(nothing to resume: this chat keeps no history)"
    try:
        saved = load(path)
    except ValueError as exc:
        return None, f"(not resumed: {exc}; starting afresh)"
    if saved is None or not saved.turns:
        return None, "(nothing to resume yet: a new conversation)"
    replies = sum(m.role == "assistant" for m in saved.turns)
    return saved, f"(resumed {replies} replies from {path})"


def keep(path: Path | None, system: str | None, turns: Sequence[ChatMessage]) -> str | None:
    """Keep the conversation at ``path`` (None: not kept); a line saying why it could not be."""
    if path is None:
        return None
    try:
        save(path, SavedChat(system=system, turns=tuple(turns)))
    except OSError as exc:
        return f"(could not keep the conversation in {path}: {exc.strerror})"
    return None
