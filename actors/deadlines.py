"""Per-request deadlines and the stall guard: when the router ends a request its engine has not.

A request with ``timeout_s`` ends ``Failed(request_timeout)`` once that long has passed since the
router accepted it; a stream with no token for its stall timeout (counted from the first token, so a
long prefill is never a stall) ends ``Failed(stream_stalled)``. The router ends it at once, so the
host hears on time even from an engine that cannot answer (a stuck compute step is what the guard is
for). Only the earliest due check has a timer (a heap holds the rest): one timer per request left
1,389 sleeping timers after a 2,000-request soak.

The protocol, counters and invariants: docs/protocols.md, "Deadlines and the stall guard".
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from runtime.errors import MlxRuntimeError, RequestTimedOut, StreamStalled
from runtime.kernel.core import Context
from runtime.kernel.stats import Counters
from runtime.messages import (
    EngineEvent,
    EngineTerminal,
    Generate,
    Prewarm,
    RequestDeadline,
    SequenceStarted,
    StallCheck,
    TokensProduced,
    Usage,
)

GuardTimer = RequestDeadline | StallCheck

# Timers fire at float sums of the clock; a check due within this is due.
_SLACK_S = 1e-9


@dataclass
class _Guarded:
    """What the router needs to end one live request on time, and with the usage it was shown."""

    epoch: int
    timeout_s: float | None
    stall_timeout_s: float | None  # None: no stall guard (a prewarm, or switched off)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    shown_tokens: int = 0
    last_token_at: float = 0.0
    shown_at_arming: int | None = None  # tokens shown when the pending stall check was armed

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            completion_tokens=self.shown_tokens,
        )


@dataclass(frozen=True)
class Expiry:
    """A request the router must end now: the typed error and the usage it was shown."""

    error: MlxRuntimeError
    usage: Usage


class RequestGuards:
    """The deadlines and stall guards of the router's live requests (see module docstring).

    ``stall_timeout_s`` is the runtime's default; None turns the stall guard off unless a
    request asks for one. The router tells it when a request is accepted, shown something, or
    ended; it answers a fired timer with an ``Expiry`` or None.
    """

    def __init__(self, stall_timeout_s: float | None, counters: Counters) -> None:
        self._default_stall_s = stall_timeout_s
        self._counters = counters
        self._guarded: dict[int, _Guarded] = {}  # sequence id → guard, while the request lives
        self._expired: dict[int, int] = {}  # sequence id → epoch, until the engine's terminal
        self._due: list[tuple[float, int, GuardTimer]] = []  # (when, order, check): a heap
        self._order = 0
        self._armed_at: float | None = None  # when the one pending timer fires

    @property
    def awaiting_engine(self) -> frozenset[int]:
        """Sequence ids of requests ended here whose engine has not sent its terminal yet."""
        return frozenset(self._expired)

    @property
    def expired_awaiting_engine(self) -> int:
        """Requests ended here whose engine has not yet sent its own terminal."""
        return len(self._expired)

    def accepted(
        self,
        request: Generate | Prewarm,
        sequence_id: int,
        epoch: int,
        ctx: Context,
        since: float | None = None,
    ) -> None:
        """A request was accepted: guard it if it has a deadline or (a generate) a stall guard.
        ``since``: when it was first accepted (a request moved to another replica keeps its
        deadline); None: now."""
        stall_s = None
        timeout_s = request.request.timeout_s
        if isinstance(request, Generate):
            own = request.request.stall_timeout_s
            stall_s = self._default_stall_s if own is None else own
        if timeout_s is None and stall_s is None:
            return
        self._guarded[sequence_id] = _Guarded(epoch, timeout_s, stall_s)
        if timeout_s is not None:
            left = timeout_s - (0.0 if since is None else ctx.now() - since)
            self._schedule(max(0.0, left), RequestDeadline(sequence_id=sequence_id), ctx)

    def shown(self, event: SequenceStarted | TokensProduced, ctx: Context) -> None:
        """The router forwarded ``event`` to the host: count it; the first token arms the
        stall guard."""
        guard = self._guarded.get(event.sequence_id)
        if guard is None:
            return
        if isinstance(event, SequenceStarted):
            guard.prompt_tokens = event.prompt_tokens
            guard.cached_prompt_tokens = event.cached_tokens
            return
        guard.shown_tokens += len(event.token_ids)
        guard.last_token_at = ctx.now()
        if guard.stall_timeout_s is not None and guard.shown_at_arming is None:  # the first
            self._arm_stall_check(event.sequence_id, guard, guard.stall_timeout_s, ctx)

    def ended(self, sequence_id: int) -> None:
        """The request ended through its engine: its pending timers become stale."""
        self._guarded.pop(sequence_id, None)

    def fired(self, ctx: Context) -> list[tuple[int, Expiry]]:
        """The pending timer fired: every check now due, in order; the requests to end now (by
        sequence id), each with its ``Expiry``."""
        self._armed_at = None
        expiries = []
        while self._due and self._due[0][0] <= ctx.now() + _SLACK_S:
            _, _, check = heapq.heappop(self._due)
            expiry = self._check(check, ctx)
            if expiry is not None:
                expiries.append((check.sequence_id, expiry))
        if self._due and self._armed_at is None:  # (a stall check just re-set may have armed)
            self._arm(self._due[0][0], self._due[0][2], ctx)
        return expiries

    def _check(self, check: GuardTimer, ctx: Context) -> Expiry | None:
        guard = self._guarded.get(check.sequence_id)
        if guard is None:  # the request ended, through its engine or on its other check
            self._counters.inc("stale_timers")
            ctx.count_dead_letter("stale_request_timer")
            return None
        if isinstance(check, RequestDeadline) and guard.timeout_s is not None:
            error: MlxRuntimeError = RequestTimedOut(
                f"the request did not finish within its timeout_s of {guard.timeout_s:g} s "
                f"({_progress(guard)}); retry with a longer timeout_s or a smaller max_tokens"
            )
            return self._expire(check.sequence_id, guard, error)
        if isinstance(check, StallCheck) and guard.stall_timeout_s is not None:
            return self._stall_check(check.sequence_id, guard, guard.stall_timeout_s, ctx)
        return None  # (never: a check is queued only for a guard that has it)

    def _stall_check(
        self, sequence_id: int, guard: _Guarded, stall_timeout_s: float, ctx: Context
    ) -> Expiry | None:
        if guard.shown_tokens != guard.shown_at_arming:
            # Tokens came since it was armed: the window restarts at the last of them. Deciding
            # by token counts, not clock readings, keeps a timer that fires early from looping.
            rest = max(0.0, guard.last_token_at + stall_timeout_s - ctx.now())
            self._arm_stall_check(sequence_id, guard, rest, ctx)
            self._counters.inc("stall_checks_passed")
            return None
        error = StreamStalled(
            f"the stream produced no token for {stall_timeout_s:g} s ({_progress(guard)}); "
            "the engine may be stuck or overloaded: retry, and if it keeps happening check "
            "the engine's statistics or raise stall_timeout_s"
        )
        return self._expire(sequence_id, guard, error)

    def absorbs(self, event: EngineEvent, ctx: Context) -> bool:
        """Whether ``event`` is about a request ended here (then it is dropped and counted)."""
        if event.sequence_id not in self._expired:
            return False
        if isinstance(event, EngineTerminal):
            del self._expired[event.sequence_id]  # the engine has let go of it: nothing follows
        self._counters.inc("events_after_expiry")
        ctx.count_dead_letter("event_after_expiry")
        return True

    def epoch_drained(self, epoch: int) -> None:
        """Defensive: an engine sends every terminal before ``Drained``; forget any it did not."""
        for sequence_id in [s for s, e in self._expired.items() if e == epoch]:
            del self._expired[sequence_id]

    def _expire(self, sequence_id: int, guard: _Guarded, error: MlxRuntimeError) -> Expiry:
        del self._guarded[sequence_id]
        self._expired[sequence_id] = guard.epoch
        self._counters.inc(f"expired_{error.code}")
        return Expiry(error, guard.usage())

    def _arm_stall_check(
        self, sequence_id: int, guard: _Guarded, delay_s: float, ctx: Context
    ) -> None:
        guard.shown_at_arming = guard.shown_tokens
        self._schedule(delay_s, StallCheck(sequence_id=sequence_id), ctx)

    def _schedule(self, delay_s: float, check: GuardTimer, ctx: Context) -> None:
        """Queue ``check`` ``delay_s`` from now; a timer only if due before the pending one."""
        when = ctx.now() + delay_s
        self._order += 1
        heapq.heappush(self._due, (when, self._order, check))
        if self._armed_at is None or when < self._armed_at - _SLACK_S:
            self._arm(when, check, ctx)

    def _arm(self, when: float, check: GuardTimer, ctx: Context) -> None:
        self._armed_at = when
        ctx.send_later(max(0.0, when - ctx.now()), check)


def _progress(guard: _Guarded) -> str:
    if guard.shown_tokens:
        return f"after {guard.shown_tokens} generated tokens"
    return "before its first token"
