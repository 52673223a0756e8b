"""The backend's idle housekeeping (``Backend.tidy``), run a piece at a time once the engine idles.

Some work can be done ahead of the request that needs it (on llama.cpp, moving an idle state to host
memory so that a sequence slot is free). It runs only once the compute slot has idled
``TIDY_AFTER_S``, so a client that sends its next request right after a reply finds none in its way,
and a piece at a time, so a request waits at most one piece. Each idle period has a number, so a
``TidyDue`` from an earlier one is stale; one timer is in flight at a time. A piece that raises
stops tidying for the epoch: it is only an optimisation.

See docs/design.md and docs/protocols.md (``TidyDue``).
"""

from __future__ import annotations

import logging

from actors.engine.compute import ComputeSlot
from actors.engine.jobs import TidyJob, run_tidy
from runtime.backends.contract import Backend
from runtime.kernel.core import Context
from runtime.kernel.stats import Counters
from runtime.messages import TidyDue

log = logging.getLogger("mlx_actor_runtime.engine")

# Idle this long before housekeeping: longer than a client's turnaround between two requests
# (a few ms here), far shorter than a person's next turn.
TIDY_AFTER_S = 0.1


class Tidying:
    """Whether housekeeping is due, and its pieces' jobs."""

    def __init__(self, model: str, counters: Counters) -> None:
        self._model = model
        self._counters = counters
        self._period = 0  # the current idle period's number
        self._in_flight = False  # a TidyDue is pending (a timer cannot be cancelled: one at a
        # time, so an engine that idles often leaves at most one sleeping)
        self._due = False  # this period's timer fired, or the last piece did something
        self._finished = False  # nothing left to do until work runs again
        self._broken = False  # a piece raised: no more tidying this epoch

    def work_started(self) -> None:
        """Other compute started: the idle period ends, and there may be housekeeping again."""
        self._period += 1
        self._due = self._finished = False

    def start(self, backend: Backend, compute: ComputeSlot, ctx: Context) -> bool:
        """With the slot idle: run a piece if one is due, else arm this period's timer (False:
        nothing started)."""
        if self._broken or self._finished or compute.busy:
            return False
        if self._due:
            job = TidyJob()
            compute.submit(ctx, job, lambda: run_tidy(job, backend))
            return True
        if not self._in_flight:  # once this period's has fired it is due, finished or broken
            self._in_flight = True
            ctx.send_later(TIDY_AFTER_S, TidyDue(idle_period=self._period))
        return False

    def timer(self, message: TidyDue) -> bool:
        """A ``TidyDue`` came: whether it is this period's (either way the core then pumps, which
        arms one for the current period if it idles)."""
        self._in_flight = False
        if message.idle_period != self._period:
            return False
        self._due = True
        return True

    def done(self, job: TidyJob) -> None:
        """A piece came back: another is due at once if it did something."""
        if job.error is not None:
            self._broken = True
            self._counters.inc("tidy_failed")
            log.warning("model %s: idle housekeeping failed (%r); it stops", self._model, job.error)
        elif job.did:
            self._counters.inc("tidy_pieces")
        else:
            self._finished = True
        self._due = job.did and job.error is None
