"""Restart intensity: how often an actor may crash and be recovered before the crash escalates.

As in Erlang/OTP, more than ``max_restarts`` crashes within ``within_s`` seconds means recovery is
not working; the supervisor then escalates (the runtime's task group fails loudly) instead of
looping.
"""

from __future__ import annotations

from collections import deque

import msgspec


class RestartPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """``max_restarts`` recoveries allowed within any ``within_s``-second window."""

    max_restarts: int = 3
    within_s: float = 60.0


class RestartTracker:
    """Remembers recent crashes of one actor and decides whether another restart is allowed."""

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._crashes: deque[float] = deque()

    def may_restart(self, now: float) -> bool:
        """Record a crash at ``now``; True while the restart intensity is not exceeded."""
        self._crashes.append(now)
        while self._crashes and now - self._crashes[0] > self._policy.within_s:
            self._crashes.popleft()
        return len(self._crashes) <= self._policy.max_restarts
