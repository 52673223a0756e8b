"""The engine's one compute slot: the jobs on its executor, and whether a sequence is in one.

A job runs on the executor (``ctx.compute``, one at a time, in order); its ``ComputeDone`` names it
by id, and ``done`` hands the record back to the engine core. The slot carries out the plan that
``StepPlanner`` (plan.py) decides, and it alone sets and clears ``Sequence.in_compute``: set when
it hands a sequence to a job, cleared in ``done``. A prefill chunk's time feeds the ``ChunkSizer``.

While nothing else is ready to run (``top_up``, where ``Backend.queues_steps``), a lone stream keeps
its next decode step queued behind its running one, and a lone prompt's first draw waits behind the
chunk that ends it: the token computes while the loop shows the last. See docs/design.md, One step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import assert_never

from actors.engine.batch import BatchScheduler
from actors.engine.chunking import ChunkSizer
from actors.engine.decode import run_batch, run_decode
from actors.engine.emission import fresh_decoding
from actors.engine.entries import EntryStore, RestoreSource
from actors.engine.gate import may_take
from actors.engine.jobs import (
    BatchJob,
    CloseJob,
    Job,
    LoadJob,
    StepJob,
    TogetherJob,
    TokenizeJob,
    run_step,
    run_together,
    run_tokenize,
)
from actors.engine.plan import SCHEDULED, BatchStep, Decode, Prefill, StepPlanner, Tokenize
from actors.engine.sequence import Phase, Sequence
from actors.engine.watchdog import Watchdog
from runtime.backends.contract import Backend
from runtime.errors import StepTimedOut
from runtime.kernel.core import PREFIX_CACHE, Context
from runtime.messages import ComputeDone, ReleaseLease


class ComputeSlot:
    """Jobs in flight by id (one at a time) and the choice of the next one (module docstring).

    Reads the engine's ``sequences``; marks the ones it hands to a job ``in_compute``.
    """

    def __init__(
        self,
        sizer: ChunkSizer,
        sequences: dict[int, Sequence],
        batches: BatchScheduler,
        entries: EntryStore,
        planner: StepPlanner,
        watchdog: Watchdog,
    ) -> None:
        self._sizer = sizer
        self._watchdog = watchdog
        self._planner = planner
        self._sequences = sequences
        self._batches = batches
        self._entries = entries
        self._jobs: dict[int, tuple[Job, float]] = {}  # by id: the job and when it was submitted
        self._next_job_id = 1
        # Set while other work waits for the slot: a running decode block ends early (decode.py).
        self._waiting = threading.Event()

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    def overran(self, model: str) -> StepTimedOut:
        """What the sequences of an engine whose running job overran the limit fail with."""
        return StepTimedOut(
            f"a compute step of model {model!r} ran longer than step_timeout_s="
            f"{self._watchdog.limit_s:g} s; the model is reloaded: retry the request (raise "
            "RuntimeConfig.step_timeout_s if steps this long are expected)"
        )

    @property
    def watched_busy(self) -> bool:
        """Whether a job the watchdog watches (not a load or a close) is in flight."""
        return any(not isinstance(job, _UNWATCHED) for job, _ in self._jobs.values())

    def overdue(self, ctx: Context) -> bool:
        """The watchdog's timer fired: has the running job overrun ``step_timeout_s``?"""
        return self._watchdog.overdue(self.watched_busy, ctx)

    def abandon(self) -> list[Job]:
        """Forget every job in flight (the engine gave up on its compute); returns them."""
        jobs = [job for job, _ in self._jobs.values()]
        self._jobs.clear()
        return jobs

    def holds(self, seq: Sequence) -> bool:
        """Whether a step of ``seq`` is in flight (queued or running)."""
        return any(isinstance(j, StepJob) and j.seq is seq for j, _ in self._jobs.values())

    def submit(self, ctx: Context, job: Job, work: Callable[[], None]) -> None:
        """Run ``work`` (which fills ``job``) on the executor; ``ComputeDone`` follows."""
        job_id = self._next_job_id
        self._next_job_id += 1
        idle = not self._jobs
        self._jobs[job_id] = (job, ctx.now())
        if not isinstance(job, _UNWATCHED):
            self._watchdog.job_submitted(idle, ctx)
        ctx.compute(work, ComputeDone(job_id=job_id))

    def done(self, job_id: int, ctx: Context) -> Job:
        """The record of the job that ``ComputeDone(job_id)`` reports; the slot is free again, and
        its sequences are out of compute (unless another step of one is queued)."""
        job, submitted = self._jobs.pop(job_id)
        self._watchdog.job_ended(ctx)
        match job:
            case StepJob(seq=seq):
                owner = seq.live_successor()  # an adopter took over the prewarm's step
                owner.in_compute = self.holds(owner)
            case TogetherJob(steps=steps):
                for step in steps:
                    step.seq.live_successor().in_compute = False
            case BatchJob(work=work):
                for seq in (*work.leavers, *work.joiners, *work.members):
                    seq.in_compute = False
        if isinstance(job, StepJob) and job.chunk_tokens and job.error is None:
            self._sizer.observe(job.prefilled, ctx.now() - submitted)
        return job

    def start_next(self, backend: Backend, ctx: Context) -> bool:
        """Run the planner's next step, if any (False: nothing to run)."""
        self._waiting.clear()  # the slot is free: whatever waited is scheduled from here
        plan = self._planner.next(backend.info, ctx)
        match plan:
            case None:
                return False
            case Tokenize(seqs=seqs):
                tokenize = TokenizeJob()
                self.submit(ctx, tokenize, lambda: run_tokenize(tokenize, seqs, backend))
            case BatchStep(work=work):
                for seq in (*work.leavers, *work.joiners, *work.members):
                    seq.in_compute = True
                job = BatchJob(work, yield_to=self._waiting)
                batch = self._batches.handle
                self.submit(ctx, job, lambda: run_batch(job, backend, batch))
            case Decode(seq=seq, ahead=ahead):
                seq.in_compute = True
                step = StepJob(seq, build_ahead=not ahead, yield_to=self._waiting)
                self.submit(ctx, step, lambda: run_decode(step, seq, backend))
                if not ahead:
                    self.top_up(backend, ctx)
            case Prefill(seqs=(seq,), chunk=chunk):
                seq.in_compute = True
                # Decided before it runs: the running chunk moves the state's length.
                ends = seq.state is not None and 0 < seq.prefill_rest <= chunk
                single = StepJob(seq, chunk_tokens=chunk, ends_prompt=ends)
                # Leased: never dropped meanwhile.
                source = (
                    seq.disk_source
                    or self._take(seq, ctx)
                    or self._entries.restore_source(seq.restore_entry, seq.restore_length)
                )
                # The job holds it now; the restore copies what it needs (or cuts a taken one).
                seq.disk_source = None
                self.submit(ctx, single, lambda: run_step(single, seq, backend, source))
                self.top_up(backend, ctx)
            case Prefill(seqs=group):
                together = TogetherJob([StepJob(s) for s in group])
                for member in group:
                    member.in_compute = True
                self.submit(ctx, together, lambda: run_together(together, backend))
            case _:
                assert_never(plan)
        return True

    def _take(self, seq: Sequence, ctx: Context) -> RestoreSource | None:
        """Take the sequence's leased entry for its restore instead of copying it, where the
        prefix cache allowed it (``LookupResult.takeable``) and no other sequence here holds or
        awaits that entry (``gate.may_take``); the manager forgets it on ``ReleaseLease(take)``."""
        if (
            seq.phase is not Phase.RESTORING
            or seq.state is not None
            or seq.lease_id is None
            or seq.restore_entry is None
            or not may_take(seq, self._sequences.values())
        ):
            return None
        source = self._entries.take(seq.restore_entry, seq.restore_length, ctx)
        if source is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id, take=True))
            seq.lease_id, seq.taken = None, True
        return source

    def note_waiting(self) -> None:
        """While the slot is busy: if a sequence other than those in flight has compute work,
        ask a running decode block to end after its current token."""
        if self._waiting.is_set():
            return
        held: set[int] = set()
        for job, _ in self._jobs.values():
            if isinstance(job, StepJob):
                held.add(id(job.seq))
            elif isinstance(job, BatchJob):
                held.update(id(s) for s in (*job.work.joiners, *job.work.members))
        if any(s.phase in SCHEDULED and id(s) not in held for s in self._sequences.values()):
            self._waiting.set()

    def top_up(self, backend: Backend, ctx: Context) -> None:
        """Queue a lone stream's next decode step behind its running one, or its first draw
        behind the chunk that ends its prompt (module docstring)."""
        if not backend.queues_steps or len(self._jobs) != 1:
            return
        ((running, _),) = self._jobs.values()
        if not isinstance(running, StepJob):
            return
        if running.ends_prompt:
            self._first_draw_behind(running.seq, backend, ctx)
            return
        plan = self._planner.behind(running.seq)
        if plan is None:
            return
        seq = plan.seq
        step = StepJob(seq, queued=True, yield_to=self._waiting)
        self.submit(ctx, step, lambda: run_decode(step, seq, backend))

    def _first_draw_behind(self, seq: Sequence, backend: Backend, ctx: Context) -> None:
        """Queue ``seq``'s first draw behind the chunk that ends its prompt, so the token follows
        the prompt without a trip through the loop; the decoding it fills is the one
        ``start_decoding`` takes when the chunk's outcome lands."""
        if not self._planner.first_draw_behind(seq):
            return
        decoding = seq.next_decoding = fresh_decoding(seq, backend.decode)
        step = StepJob(seq, queued=True, first=decoding, yield_to=self._waiting)
        self.submit(ctx, step, lambda: run_decode(step, seq, backend))


def hand_over(prewarm: Sequence, seq: Sequence) -> None:
    """``seq`` adopts ``prewarm``: a step of the prewarm in flight now holds ``seq``'s state."""
    seq.in_compute, prewarm.in_compute = prewarm.in_compute, False


# Loading and closing the model may legitimately take minutes: the watchdog leaves them be.
_UNWATCHED = (LoadJob, CloseJob)
