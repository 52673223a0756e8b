"""The engine's one compute slot: which job runs next, and the jobs handed to its executor.

Tokenizing goes first: every prompt waiting for its tokens, in one job. Then a step of the decode
batch (planned by ``BatchScheduler``) and single steps (a restore, a prefill chunk, or a decode
step of a sequence outside the batch, ``decode.run_decode``) take turns; single steps go
round-robin by sequence id. A job runs on the executor (``ctx.compute``, one at a time, in order);
its ``ComputeDone`` names it by id, and ``done`` hands the record back to the engine core, which
hands it to the part that acts on what it left. A prefill chunk's size comes from the
``ChunkSizer``, which learns the model's rate from the chunks timed here (submission to result, on
the context's clock: virtual in the simulator).

A lone decoding stream keeps one more decode step queued behind its running one (``top_up``, where
``Backend.queues_steps``), so its next token computes while the loop shows the last one, without
waiting for the loop to hand the executor more work. Only while nothing else is ready to run:
anything else waits for at most that one queued step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from actors.engine.batch import BatchScheduler
from actors.engine.chunking import ChunkSizer
from actors.engine.decode import run_batch, run_decode
from actors.engine.entries import EntryStore
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
from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from actors.engine.turns import PromptTurns, rows_taken
from actors.engine.watchdog import Watchdog
from runtime.backends.contract import Backend, Capability
from runtime.errors import StepTimedOut
from runtime.kernel.core import Context
from runtime.messages import ComputeDone, RequestKind


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
        turns: PromptTurns,
        watchdog: Watchdog,
    ) -> None:
        self._sizer = sizer
        self._watchdog = watchdog
        self._turns = turns
        self._sequences = sequences
        self._batches = batches
        self._entries = entries
        self._jobs: dict[int, tuple[Job, float]] = {}  # by id: the job and when it was submitted
        self._next_job_id = 1
        self._last_served = 0  # sequence id of the last single step: the round-robin's place
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
        """Start the next job for the sequences, if any is ready (False: nothing to run)."""
        self._waiting.clear()  # the slot is free: whatever waited is scheduled from here
        waiting = [s for s in self._sequences.values() if s.phase is Phase.TOKENIZING]
        if waiting:
            tokenize = TokenizeJob()
            self.submit(ctx, tokenize, lambda: run_tokenize(tokenize, waiting, backend))
            return True
        now = ctx.now()
        work = self._batches.work(self._sequences.values(), ctx)
        batched = set() if work is None else {id(s) for s in (*work.joiners, *work.members)}
        ready = sorted(
            (
                s
                for s in self._sequences.values()
                if s.phase in COMPUTE_PHASES
                and s.batch_slot is None
                and id(s) not in batched
                and not self._batches.holds_back(s)  # priced for a join: its length must hold
            ),
            key=lambda s: (s.sequence_id <= self._last_served, s.sequence_id),
        )
        decoders_wait = work is not None or any(s.phase is Phase.DECODING for s in ready)
        owed = False
        if decoders_wait:
            chunk = self._sizer.tokens()
            newcomer = self._turns.ahead_of_decoding(ready, self._sequences.values(), chunk, now)
            if newcomer is not None:
                self._run_single(newcomer, backend, ctx, ready, ahead_of_decoding=True)
                return True
            owed = self._turns.decode_owed(now)
            if owed:  # decoding waited its limit behind newcomers: it goes first
                ready.sort(key=lambda s: s.phase is not Phase.DECODING)
        else:
            self._turns.decode_ran()
        batch_now = self._batches.takes_turn(work, bool(ready) and not owed)
        if work is not None and batch_now:
            for seq in (*work.leavers, *work.joiners, *work.members):
                seq.in_compute = True
            job = BatchJob(work, yield_to=self._waiting)
            batch = self._batches.handle
            self.submit(ctx, job, lambda: run_batch(job, backend, batch))
            self._turns.decode_ran()
            return True
        if ready:
            self._run_single(ready[0], backend, ctx, ready, lone=not decoders_wait)
            return True
        return False

    def _run_single(
        self,
        seq: Sequence,
        backend: Backend,
        ctx: Context,
        ready: list[Sequence],
        *,
        ahead_of_decoding: bool = False,
        lone: bool = False,
    ) -> None:
        """A step of one sequence: a decode step, a restore or a prefill chunk; or the fresh
        prompts' rests of several, ``seq``'s among them, together. One that goes ahead of the decode
        work (a newcomer's, turns.py) leaves that work waiting."""
        self._last_served = seq.sequence_id
        if seq.phase is Phase.DECODING:
            seq.in_compute = True
            step = StepJob(seq, build_ahead=not ahead_of_decoding, yield_to=self._waiting)
            self.submit(ctx, step, lambda: run_decode(step, seq, backend))
            if not ahead_of_decoding:
                self._turns.decode_ran()
                self.top_up(backend, ctx)
            return
        chunk = self._sizer.tokens(lone) if seq.phase is Phase.PREFILLING else 0
        group = (
            self._together(seq, ready, chunk, backend.info.together_snapshot_tokens)
            if backend.info.capable(Capability.BATCH_PREFILL)  # the load probe may forbid it
            else [seq]
        )
        if len(group) > 1:
            together = TogetherJob([StepJob(s) for s in group])
            for member in group:
                member.in_compute = True
            self.submit(ctx, together, lambda: run_together(together, backend))
            return
        seq.in_compute = True
        step = StepJob(seq, chunk_tokens=chunk)
        # Leased: never dropped meanwhile.
        source = seq.disk_source or self._entries.restore_source(
            seq.restore_entry, seq.restore_length
        )
        seq.disk_source = None  # the job holds it now; the restore copies what it needs
        self.submit(ctx, step, lambda: run_step(step, seq, backend, source))

    def _together(
        self, seq: Sequence, ready: list[Sequence], chunk: int, snapshot_reach: int
    ) -> list[Sequence]:
        """``seq`` and the ready sequences whose prompts may be prefilled with it in one batched
        pass: each the whole rest of its prompt within one chunk, as many as the decode batch has
        rows free for, at most ``TOGETHER_CHUNKS`` chunks' tokens in all (a member's abort waits
        for the whole pass). A prompt with checkpoints to take (or its session's instructions to
        pin) joins only where the pass can snapshot inside it (``snapshot_reach`` tokens)."""
        if not self._batches.enabled or not _rest_in_one_pass(seq, chunk, snapshot_reach):
            return [seq]
        rows = self._batches.max_batch - rows_taken(self._sequences.values())
        tokens = TOGETHER_CHUNKS * chunk - seq.prefill_rest
        group = [seq]
        for other in ready:
            if len(group) >= rows:
                break
            if (
                other is not seq
                and _rest_in_one_pass(other, chunk, snapshot_reach)
                and other.prefill_rest <= tokens
            ):
                group.append(other)
                tokens -= other.prefill_rest
        return group

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
        if any(s.phase in _SCHEDULED and id(s) not in held for s in self._sequences.values()):
            self._waiting.set()

    def top_up(self, backend: Backend, ctx: Context) -> None:
        """Queue a lone stream's next decode step behind its running one (module docstring)."""
        if not backend.queues_steps or len(self._jobs) != 1:
            return
        ((running, _),) = self._jobs.values()
        if not isinstance(running, StepJob):
            return
        seq = running.seq
        if (
            seq.phase is not Phase.DECODING
            or seq.batch_slot is not None
            or seq.abort.is_set()
            or len(self._batches)
            or self._batches.has_leaving
            or any(s is not seq and s.phase in _SCHEDULED for s in self._sequences.values())
        ):
            return
        step = StepJob(seq, queued=True, yield_to=self._waiting)
        self.submit(ctx, step, lambda: run_decode(step, seq, backend))


def hand_over(prewarm: Sequence, seq: Sequence) -> None:
    """``seq`` adopts ``prewarm``: a step of the prewarm in flight now holds ``seq``'s state."""
    seq.in_compute, prewarm.in_compute = prewarm.in_compute, False


# A batched prefill of fresh prompts takes at most this many chunks' tokens.
TOGETHER_CHUNKS = 4


def _rest_in_one_pass(seq: Sequence, chunk: int, snapshot_reach: int) -> bool:
    """A generate about to prefill the whole rest of its prompt (past what it restored), 2 tokens
    or more within one chunk; one with snapshots to take on the way (checkpoints, its pinned
    instructions) only if a batched pass can take them (``ModelInfo.together_snapshot_tokens``)."""
    if not (
        seq.kind is RequestKind.GENERATE
        and seq.phase is Phase.PREFILLING
        and seq.state is not None
        and seq.tokens is not None
        and 2 <= seq.prefill_rest <= chunk
    ):
        return False
    # The checkpoints include the pin (planned at the restore, jobs.py).
    return not seq.checkpoints or len(seq.tokens) <= snapshot_reach


# Loading and closing the model may legitimately take minutes: the watchdog leaves them be.
_UNWATCHED = (LoadJob, CloseJob)

# Phases with work for the compute slot: any sequence in them keeps a stream from queueing ahead.
_SCHEDULED = COMPUTE_PHASES | {Phase.TOKENIZING}
