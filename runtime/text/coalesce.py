"""Token coalescing: batch streamed tokens into fewer, larger chunks.

One event per token costs a message, a JSON frame and a syscall each; a client reading text wants
words, not tokens. ``Coalescer`` sends a stream's first text at once (a client waits on the first
token), then buffers text until it reaches ``max_chars`` or its oldest text is ``max_age_s`` old. It
holds no timer: the caller passes ``now`` and asks ``next_deadline`` when to call ``due``, so hosts
drive it with their own clocks and tests with plain numbers. A chunk is at most ``max_chars`` long
unless one ``add`` alone was longer: text is never split, a chunk keeps whole tokens with their ids.

See docs/http.md, "Streaming and coalescing".
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from runtime.errors import InvalidRequest


class CoalescePolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How much streamed text to batch; ``enabled=False`` gives one chunk per token (logprobs).

    Raises ``InvalidRequest`` if ``max_chars`` is below 1 or ``max_age_s`` is negative.
    """

    max_chars: int = 32
    max_age_s: float = 0.05
    enabled: bool = True

    def __post_init__(self) -> None:
        if self.max_chars < 1:
            raise InvalidRequest(f"max_chars must be at least 1, got {self.max_chars}.")
        if self.max_age_s < 0:
            raise InvalidRequest(f"max_age_s must not be negative, got {self.max_age_s}.")


class Chunk(msgspec.Struct, frozen=True):
    """Text to send as one event, with the ids of the tokens that produced it, in order."""

    text: str
    token_ids: tuple[int, ...]


class Coalescer:
    """Buffers ``add``-ed tokens; every method that returns a ``Chunk`` has emptied the buffer.

    Call ``flush`` before sending any non-token event (so text never arrives after it) and at the
    end of the stream. ``now`` is any monotonic clock in seconds, the same one for every call.
    """

    def __init__(self, policy: CoalescePolicy) -> None:
        self._policy = policy
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._chars = 0
        self._deadline: float | None = None  # set when the buffer stops being empty
        self._first_sent = False  # whether a chunk with text went out: until then, no waiting

    @property
    def policy(self) -> CoalescePolicy:
        return self._policy

    def add(self, text: str, token_ids: Sequence[int], now: float) -> Chunk | None:
        """Buffer one token's text; return a chunk when one is full or the buffer is overdue."""
        if not self._policy.enabled:
            return Chunk(text, tuple(token_ids))
        if not self._first_sent and text:
            self._append(text, token_ids, now)
            return self.flush()
        max_chars = self._policy.max_chars
        if self._chars and self._chars + len(text) > max_chars and len(text) < max_chars:
            # Send what fits now and start the next chunk with this text, which fits on its own.
            chunk = self.flush()
            self._append(text, token_ids, now)
            return chunk
        self._append(text, token_ids, now)
        if self._chars >= max_chars:
            return self.flush()
        return self.due(now)

    def due(self, now: float) -> Chunk | None:
        """The buffered chunk if its oldest text is ``max_age_s`` old at ``now``, else None."""
        if self._deadline is not None and now >= self._deadline:
            return self.flush()
        return None

    def next_deadline(self) -> float | None:
        """When to call ``due`` next (the oldest text turns ``max_age_s`` old); None if empty."""
        return self._deadline

    def flush(self) -> Chunk | None:
        """Everything buffered as one chunk (None if empty); call before any non-token event."""
        if self._deadline is None:
            return None
        chunk = Chunk("".join(self._texts), tuple(self._token_ids))
        self._first_sent = self._first_sent or bool(chunk.text)
        self._texts.clear()
        self._token_ids.clear()
        self._chars = 0
        self._deadline = None
        return chunk

    def _append(self, text: str, token_ids: Sequence[int], now: float) -> None:
        if not text and not token_ids:
            return
        if self._deadline is None:
            self._deadline = now + self._policy.max_age_s
        self._texts.append(text)
        self._token_ids.extend(token_ids)
        self._chars += len(text)
