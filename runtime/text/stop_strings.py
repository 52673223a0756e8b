"""Stop strings matched across token boundaries on streamed text.

Text arrives in pieces that split words anywhere, so a stop string may begin in one piece and end
several later. ``StopStringMatcher`` holds back the shortest tail that could still grow into a stop
string and emits the rest. Each stop keeps a KMP state: each character is examined once per stop,
and the tail is under ``max(len(stop))``. Which stop wins: the one that *completes* first; of those
completing on the same character, the longest (it starts earliest). That is the only rule whose
result does not depend on where the text was split, so a stream stops exactly where matching the
whole text would. See docs/streaming.md, "Stop strings".
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from runtime.errors import InvalidRequest


class StopResult(msgspec.Struct, frozen=True):
    """What one ``feed`` lets the caller emit; ``stop`` is the stop string that ended the stream."""

    text: str
    stopped: bool = False
    stop: str | None = None


class _KmpStop:
    """One stop string as a KMP automaton; ``state``: how much of it the text so far ends with."""

    __slots__ = ("failure", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0
        # failure[i]: length of the longest proper border of stop[: i + 1].
        self.failure = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.failure[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.failure[i] = k

    def advance(self, char: str) -> bool:
        """Consume one character; True when the whole stop string has just been seen."""
        k = self.state
        while k and char != self.stop[k]:
            k = self.failure[k - 1]
        if char == self.stop[k]:
            k += 1
        if k == len(self.stop):
            self.state = self.failure[k - 1]
            return True
        self.state = k
        return False


class StopStringMatcher:
    """Feed streamed text with ``feed``; call ``flush`` when the stream ends without a stop.

    Raises ``InvalidRequest`` if any stop string is empty (it would match before any text).
    After a stop, ``feed`` and ``flush`` emit nothing: the stop string and all text after it are
    dropped.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        for index, stop in enumerate(stops):
            if not stop:
                raise InvalidRequest(
                    f"Stop strings must be non-empty, but stop string {index} is empty."
                )
        # Longest first, so a tie on the completing character goes to the longest stop.
        self._stops = [_KmpStop(stop) for stop in sorted(set(stops), key=len, reverse=True)]
        self._pending = ""  # text held back because it may be the start of a stop string
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    def feed(self, text: str) -> StopResult:
        """Consume ``text``; return what can be emitted now and whether a stop string completed."""
        if self._matched is not None:
            return StopResult("", stopped=True, stop=self._matched)
        buffer = self._pending + text
        offset = len(self._pending)
        for i, char in enumerate(text):
            for stop in self._stops:
                if stop.advance(char):
                    return self._stop_at(buffer, offset + i + 1, stop.stop)
        held = max((stop.state for stop in self._stops), default=0)
        cut = len(buffer) - held
        self._pending = buffer[cut:]
        return StopResult(buffer[:cut])

    def flush(self) -> str:
        """The held-back text, once the stream has ended without completing a stop string."""
        pending, self._pending = self._pending, ""
        for stop in self._stops:
            stop.state = 0
        return "" if self._matched is not None else pending

    def _stop_at(self, buffer: str, end: int, stop: str) -> StopResult:
        # The held-back tail covers every partial match, so the stop starts inside ``buffer``.
        self._matched = stop
        self._pending = ""
        return StopResult(buffer[: end - len(stop)], stopped=True, stop=stop)
