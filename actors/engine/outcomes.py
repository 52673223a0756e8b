"""What the engine does with a step job's or a batch step's result, back on the event loop.

A step (a restore, a prefill chunk, a decode step, or one row of a batch step) leaves its new state,
its checkpoints and snapshots, and a token or an error in its ``StepJob``. Once the state is taken
in (a restore that fell back to a cold prefill noted), the sequence goes on: ended already, aborted
meanwhile, failed, its prefill advanced (``prefill_advanced``: the start announced; once the prompt
is in, a prewarm is done and a generate starts decoding) or its token shown (emission.py says
whether it ends it). A batch step first settles who came back out of the batch, then each row's
step. Endings go through ``Endings``. See docs/design.md ("One step").
"""

from __future__ import annotations

import logging

from actors.engine import emission
from actors.engine.batch import BatchScheduler
from actors.engine.draft_model import DraftModel
from actors.engine.endings import Endings
from actors.engine.entries import EntryStore
from actors.engine.jobs import BatchJob, StepJob
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import Backend
from runtime.errors import BackendError, MlxRuntimeError
from runtime.kernel.core import PREFIX_CACHE, Context
from runtime.kernel.stats import Counters
from runtime.messages import FinishReason, ReleaseLease, RequestKind, ReusePath

log = logging.getLogger("mlx_actor_runtime.engine")


class StepOutcomes:
    """Acts on what one engine's step and batch jobs leave (see module docstring).

    ``sequences`` is the engine's table of live sequences, read only.
    """

    def __init__(
        self,
        sequences: dict[int, Sequence],
        entries: EntryStore,
        batches: BatchScheduler,
        ends: Endings,
        counters: Counters,
    ) -> None:
        self._sequences = sequences
        self._entries = entries
        self._batches = batches
        self._ends = ends
        self._counters = counters
        self._backend: Backend | None = None  # steps come back only while the model is loaded
        self._draft: DraftModel | None = None

    def loaded(self, backend: Backend | None, draft: DraftModel | None = None) -> None:
        """The engine's model (and its draft model) is in; None again once it is closed."""
        self._backend, self._draft = backend, draft

    def step_done(
        self, job: StepJob, seq: Sequence, ctx: Context, still_queued: bool = False
    ) -> None:
        """``seq``'s step came back (``seq`` owns its work now: the job's, or its adopter);
        ``still_queued``: another step of it is queued behind this one (compute.py)."""
        self._counters.inc(
            "decoded_tokens" if seq.phase is Phase.DECODING else "prefilled_tokens", job.prefilled
        )
        if job.fallback is not None:
            self._fell_back(seq, job.fallback, ctx)
        if job.state is not None:
            seq.state = job.state
            if seq.path is ReusePath.CHECKPOINT and job.state.length > seq.cached_tokens:
                self._reached(seq, job.state.length)
        if job.checkpoints is not None:
            seq.checkpoints = job.checkpoints
        del seq.checkpoints[: job.passed]  # the chunk went past them: each left one of the two
        if job.pin_copy is not None:
            assert self._backend is not None
            self._entries.pin_copy(seq, job.pin_copy, self._backend, ctx)
        for snapshot in job.snapshots:
            self._entries.snapshot(seq, snapshot)
        if seq.phase is Phase.DONE:
            if seq.ending is not None and not still_queued:  # this step held its state
                self._ends.settle(seq, seq.ending, ctx)
            return
        if seq.abort.is_set() or job.skipped:
            records = (job, *job.more)
            failed = any(r.error is not None for r in records) or job.ahead_error is not None
            self._ends.finish_cancelled(seq, ctx, keep=not failed)
            return
        if job.error is not None:
            self._ends.fail(seq, ctx, _step_failed(job.error))
            return
        if seq.phase in (Phase.WAITING, Phase.RESERVING):  # adopted mid-step: resumes once reserved
            if seq.resume_phase is Phase.RESTORING:
                seq.resume_phase = Phase.PREFILLING
            return
        if seq.phase is Phase.RESTORING:
            seq.move(Phase.PREFILLING)
        if seq.phase is Phase.PREFILLING:
            self.prefill_advanced(seq, ctx)
        elif seq.phase is Phase.DECODING and job.token is not None:
            if job.drafted:
                self._counters.inc("speculative_passes")
                self._counters.inc("drafted_tokens", job.drafted)
                self._counters.inc("accepted_tokens", job.accepted)
            self._show(job, seq, ctx)

    def _reached(self, seq: Sequence, length: int) -> None:
        """The restore cut the entry back past the checkpoint the lookup found, to where the
        prompt leaves it (``Sequence.reach_length``): a trim, which reuses more."""
        self._counters.inc("reached_past_checkpoint")
        self._counters.inc("reached_tokens", length - seq.cached_tokens)
        seq.cached_tokens, seq.path = length, ReusePath.TRIM

    def _fell_back(self, seq: Sequence, reason: str, ctx: Context) -> None:
        """The restore could not use the lookup's hit (``reason``): the prompt is prefilled cold."""
        self._counters.inc(f"fallback_{reason}")  # before Started: nothing was counted as reused
        log.debug("sequence %d: reuse fell back to a cold prefill (%s)", seq.sequence_id, reason)
        seq.cached_tokens, seq.path = 0, ReusePath.MISS
        if seq.lease_id is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
            seq.lease_id = None

    def _show(self, job: StepJob, seq: Sequence, ctx: Context) -> None:
        """Show a decode step's token, then any more of its block (a decode or speculative
        block's), each taken as a step of its own, until one ends the sequence or failed; what
        they show goes out together (``emission.emit_block``), before that ending."""
        shown: list[emission.Emission] = []
        for record in (job, *job.more):
            if record.error is not None:
                emission.emit_block(seq, shown, ctx)
                self._ends.fail(seq, ctx, _step_failed(record.error))
                return
            assert record.token is not None
            taken = emission.take_token(
                seq, record.token, record.text, record.logprob, record.completes_constraint
            )
            shown.append(taken)
            if taken.finish is not None:
                emission.emit_block(seq, shown, ctx)
                # A state that saw the next step fail is never reused.
                keep = job.ahead_error is None
                self._ends.finish(seq, ctx, taken.finish, stop=taken.stop, keep=keep)
                return
        emission.emit_block(seq, shown, ctx)
        if job.ahead_error is not None:
            self._ends.fail(seq, ctx, _step_failed(job.ahead_error))

    def prefill_advanced(self, seq: Sequence, ctx: Context) -> None:
        """A prefill chunk (or the restore before it) landed: announce the start once, and once
        the prompt is in, a prewarm is done and a generate starts decoding."""
        emission.announce_start(seq, self._counters, ctx)
        assert seq.state is not None
        if seq.state.length < seq.prefill_target:
            return
        if seq.kind is RequestKind.PREWARM:
            self._ends.finish(seq, ctx, FinishReason.PREWARMED)
            return
        assert self._backend is not None
        if seq.next_decoding is not None:  # its first draw was queued behind this chunk
            self._counters.inc("first_draws_queued")
        emission.start_decoding(seq, self._backend.decode, self._draft)

    def batch_done(self, job: BatchJob, ctx: Context) -> None:
        """A batch step came back: settle who left, then act on each row's step."""
        done = self._batches.done(job, ctx)
        for seq, leaving in done.returned:
            if leaving is None:  # aborted while it waited for this step
                self._ends.finish_cancelled(seq, ctx, keep=job.error is None)
            elif not leaving.resume:
                self._ends.returned(seq, leaving.detach, ctx)
        if job.error is not None:
            error = BackendError(f"batched decode step failed: {job.error!r}")
            for seq in done.failed:
                self._ends.fail(seq, ctx, error)
            for seq in done.orphaned:
                self._ends.release_holdings(seq, ctx)
        for seq, step in done.stepped:
            self.step_done(step, seq, ctx)


def _step_failed(error: BaseException) -> MlxRuntimeError:
    """What a step's error fails its sequence with: ours as it is (e.g. a logit bias outside the
    vocabulary), anything else as a backend error."""
    if isinstance(error, MlxRuntimeError):
        return error
    return BackendError(f"model step failed: {error!r}")
