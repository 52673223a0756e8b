"""Per-request timings in llama-server's shape (``timings``), from when the request's events came.

No timing in the hot path: the clock is read once per event the HTTP layer already receives. The
prompt time runs from ``Started`` (the engine has restored what the cache held and starts
prefilling the rest) to the first token; the generation time from the first token to the terminal
event, so ``predicted_n`` counts the first token, as llama-server's does. Token counts are the
runtime's usage: ``prompt_n`` the prompt tokens prefilled, ``cache_n`` those restored from the
cache (their sum is ``usage.prompt_tokens``), ``predicted_n`` the completion tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from runtime.messages import HostEvent, Started, TokensEmitted, Usage
from runtime.server.replies import Timings


class RequestClock:
    """When one request started, produced its first token and ended (``clock`` seconds)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._started: float | None = None
        self._first_token: float | None = None
        self._ended: float | None = None

    def saw(self, event: HostEvent | None) -> None:
        """Note the time of ``event`` if it is one the timings use (None: the stream closed)."""
        if isinstance(event, Started):
            self._started = self._clock()
        elif isinstance(event, TokensEmitted):
            if self._first_token is None and event.token_ids:
                self._first_token = self._clock()
        elif self._ended is None:
            self._ended = self._clock()

    def timings(self, usage: Usage) -> Timings:
        """The request's timings; call once its terminal event was seen."""
        end = self._clock() if self._ended is None else self._ended
        first = end if self._first_token is None else self._first_token
        start = first if self._started is None else self._started
        prompt_n = usage.prompt_tokens - usage.cached_prompt_tokens
        prompt_ms = max(first - start, 0.0) * 1000
        predicted_ms = max(end - first, 0.0) * 1000
        return Timings(
            prompt_n=prompt_n,
            prompt_ms=prompt_ms,
            prompt_per_token_ms=_per_token(prompt_ms, prompt_n),
            prompt_per_second=_per_second(prompt_ms, prompt_n),
            predicted_n=usage.completion_tokens,
            predicted_ms=predicted_ms,
            predicted_per_token_ms=_per_token(predicted_ms, usage.completion_tokens),
            predicted_per_second=_per_second(predicted_ms, usage.completion_tokens),
            cache_n=usage.cached_prompt_tokens,
            max_tokens_clamped_to=(
                msgspec.UNSET
                if usage.max_tokens_clamped_to is None
                else usage.max_tokens_clamped_to
            ),
            draft_n=usage.drafted_tokens or msgspec.UNSET,
            draft_n_accepted=usage.accepted_tokens if usage.drafted_tokens else msgspec.UNSET,
        )


def _per_token(ms: float, n: int) -> float | None:
    return ms / n if n > 0 else None


def _per_second(ms: float, n: int) -> float | None:
    return 1000.0 * n / ms if n > 0 and ms > 0 else None
