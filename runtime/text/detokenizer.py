"""Incremental detokenization that never emits half a character.

Decoding token by token breaks multi-byte characters and tokenizers that merge spaces; decoding the
whole output every step is quadratic. This keeps a short window: text is emitted once the window
decodes to something longer than its already-emitted prefix and does not end in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with ``add``; each call returns the newly completed text (maybe "")."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the window that gives context to the next decode
        self._read_offset = 0  # tokens before this have been emitted

    def add(self, token_id: int) -> str:
        self._tokens.append(token_id)
        emitted = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window = self._decode(self._tokens[self._prefix_offset :])
        if len(window) <= len(emitted) or window.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return window[len(emitted) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD here)."""
        emitted = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        window = self._decode(self._tokens[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._tokens)
        return window[len(emitted) :]
