"""One engine step in vLLM v1's shape: plan, run, apply.

``start`` runs the next step when the compute slot is free (``StepPlanner`` decides it, plan.py;
the slot runs it, compute.py), or else idle work (the deferred probe, tidying); while a job runs
it only keeps a lone stream's next decode step queued. ``apply`` is the one place where what a
sequence's job left is acted on: tokens to admission, steps and batch steps to ``StepOutcomes``
(which moves phases, shows tokens and ends sequences through ``Endings``). The engine core keeps
the model's own jobs (load, probe, close). See docs/design.md ("One step").
"""

from __future__ import annotations

from typing import assert_never

from actors.engine.admission import Admission
from actors.engine.compute import ComputeSlot
from actors.engine.disk_tier import DiskTier, ExportJob
from actors.engine.jobs import BatchJob, StepJob, TidyJob, TogetherJob, TokenizeJob
from actors.engine.outcomes import StepOutcomes
from actors.engine.probing import DeferredProbing
from actors.engine.tidying import Tidying
from runtime.backends.contract import Backend
from runtime.kernel.core import Context
from runtime.kernel.stats import Counters

# The jobs whose results ``apply`` acts on (the engine core acts on the model's own).
StepResult = TokenizeJob | StepJob | TogetherJob | BatchJob | TidyJob | ExportJob


class EngineStep:
    """Starts one engine's steps and applies what they leave (see module docstring)."""

    def __init__(
        self,
        compute: ComputeSlot,
        outcomes: StepOutcomes,
        admission: Admission,
        probing: DeferredProbing,
        tidying: Tidying,
        disk: DiskTier,
        counters: Counters,
    ) -> None:
        self._compute = compute
        self._outcomes = outcomes
        self._admission = admission
        self._probing = probing
        self._tidying = tidying
        self._disk = disk
        self._counters = counters

    def start(self, backend: Backend, ctx: Context, *, idle_work: bool) -> bool:
        """Start the next job if the slot is free (or queue a lone stream's next decode step
        behind its running one); ``idle_work``: the probe and tidying may run when nothing else
        does. False: the slot is free and nothing was started."""
        compute = self._compute
        if compute.busy:
            compute.note_waiting()
            compute.top_up(backend, ctx)
            return True
        if compute.start_next(backend, ctx):
            self._tidying.work_started()
            compute.note_waiting()  # what it left ready ends a block after one step
            return True
        return idle_work and (
            self._probing.start(backend, compute, ctx) or self._tidying.start(backend, compute, ctx)
        )

    def apply(self, job: StepResult, ctx: Context) -> None:
        """Act on what a finished job left."""
        match job:
            case TokenizeJob():
                self._counters.inc("prompts_tokenized", len(job.results) + len(job.failures))
                self._admission.tokenized(job, ctx)
            case StepJob():
                seq = job.seq.live_successor()
                self._outcomes.step_done(job, seq, ctx, still_queued=self._compute.holds(seq))
            case TogetherJob():
                self._counters.inc("prefills_together")
                for step in job.steps:
                    self._outcomes.step_done(step, step.seq.live_successor(), ctx)
            case BatchJob():
                self._outcomes.batch_done(job, ctx)
            case TidyJob():
                self._tidying.done(job)
            case ExportJob():
                self._disk.exported(job, ctx)
            case _:
                assert_never(job)
