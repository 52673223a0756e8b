"""The engine's watchdog: notices a compute job that runs longer than ``step_timeout_s``.

The executor runs one job at a time, so "the running job has overrun" means "compute has made no
progress for the limit": progress is a job starting on an idle executor, or a job ending (the
next one, if queued, starts then). One timer per engine at a time (``ComputeWatch``, through
``Context.send_later``, so the simulator's virtual clock drives it): when it fires with a job in
flight, either the limit has passed since the last progress (the engine is stuck: the core
treats it as crashed) or it is set again for the time left. Loading and closing the model are
not watched; a load may legitimately take minutes.
"""

from __future__ import annotations

from runtime.kernel.core import Context
from runtime.messages import ComputeWatch

# Timers fire at float sums of the clock; a limit reached within this is reached.
_SLACK_S = 1e-9


class Watchdog:
    """When compute last made progress, and whether a ``ComputeWatch`` timer is pending."""

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = limit_s if limit_s is not None and limit_s > 0 else None
        self._progress_at = 0.0
        self._armed = False

    def job_submitted(self, executor_was_idle: bool, ctx: Context) -> None:
        """A watched job was handed to the executor (it starts now if the executor was idle)."""
        if self.limit_s is None:
            return
        if executor_was_idle:
            self._progress_at = ctx.now()
        if not self._armed:
            self._arm(self.limit_s, ctx)

    def job_ended(self, ctx: Context) -> None:
        """A job came back: compute made progress (the next queued job started)."""
        self._progress_at = ctx.now()

    def overdue(self, busy: bool, ctx: Context) -> bool:
        """The timer fired: True when a watched job has run past the limit (else it is set again
        for the time left, while a job is in flight)."""
        self._armed = False
        if self.limit_s is None or not busy:
            return False
        left = self._progress_at + self.limit_s - ctx.now()
        if left <= _SLACK_S:
            return True
        self._arm(left, ctx)
        return False

    def _arm(self, delay_s: float, ctx: Context) -> None:
        self._armed = True
        ctx.send_later(delay_s, ComputeWatch())
