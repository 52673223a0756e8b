"""How a sequence of one engine ends, and what it gives back.

A sequence ends once: finished (``finish``), cancelled (``abort``, at once or when its running job
comes back) or failed (``fail``); it moves to ``DONE`` here and only here. What it holds (its lease,
its KV reservation, snapshots included) is released, then the router hears the terminal; a batched
sequence's release waits for its state to leave the batch (``returned``), and one whose queued
decode step still holds its state ends when that step is back (``settle``). A finished (or, unless
the model is going away, cancelled) cache is committed first; a failed one never is. After each
ending the gate lets a waiting sequence in; a leader's followers finish with it, or are let go.
See docs/design.md, "A sequence's lifecycle".
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.engine import emission
from actors.engine.batch import BatchScheduler
from actors.engine.entries import EntryStore
from actors.engine.gate import Gate
from actors.engine.jobs import Job, StepJob
from actors.engine.sequence import (
    Ending,
    Phase,
    Sequence,
    Terminal,
    release_draft,
    release_matcher,
)
from runtime.backends.contract import Backend
from runtime.errors import MlxRuntimeError
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, ROUTER, Context
from runtime.kernel.stats import Counters
from runtime.messages import FinishReason, Release, ReleaseLease, SequenceFinished


class Endings:
    """The endings of one engine's sequences (see module docstring).

    ``sequences`` is the engine's table of live sequences, shared: an ending removes from it.
    After every ending the ``gate`` lets a waiting sequence in; it also takes the followers of a
    leader that ended without a finish they share.
    """

    def __init__(
        self,
        sequences: dict[int, Sequence],
        entries: EntryStore,
        batches: BatchScheduler,
        counters: Counters,
        gate: Gate,
    ) -> None:
        self._sequences = sequences
        self._entries = entries
        self._batches = batches
        self._counters = counters
        self._gate = gate
        self._backend: Backend | None = None  # the model, while loaded: endings commit with it
        self._unloading = False

    def loaded(self, backend: Backend | None) -> None:
        """The engine's model is in (None again once it is closed or abandoned)."""
        self._backend = backend

    def unloading(self) -> None:
        """The model is going away: a cancelled sequence's cache is no longer kept."""
        self._unloading = True

    def abort(self, seq: Sequence, reason: str, ctx: Context) -> None:
        """Stop ``seq``: at once if it is not computing, else when its job comes back."""
        if seq.abort.is_set():
            return
        seq.abort_reason = reason
        seq.abort.set()
        if seq.phase in (Phase.RESTORING, Phase.PREFILLING):  # prompt work stopped part-way
            self._counters.inc("prefills_aborted")
        if not seq.in_compute:
            self.finish_cancelled(seq, ctx)

    def finish(
        self,
        seq: Sequence,
        ctx: Context,
        reason: FinishReason,
        stop: str | None = None,
        keep: bool = True,
    ) -> None:
        """``seq`` ended as ``reason``; its state is committed unless adopted or not ``keep``."""
        self._counters.inc(f"finished_{reason}")
        detach = keep and reason is not FinishReason.ADOPTED
        self._end(seq, ctx, detach, emission.finished(seq, reason, stop))

    def finish_cancelled(self, seq: Sequence, ctx: Context, keep: bool = True) -> None:
        """An aborted sequence whose job (if any) came back ends as cancelled; ``keep``: False
        when that job failed, since a state that saw an error is never reused."""
        # An aborted prefill is not wasted: its cache is kept (unless the model is going away).
        self._counters.inc("cancelled")
        if not keep:
            self._counters.inc("cancelled_after_failed_step")  # the client asked; none is told
        self._end(seq, ctx, keep and not self._unloading, emission.cancelled(seq))

    def fail(self, seq: Sequence, ctx: Context, error: MlxRuntimeError) -> None:
        self.fail_with(seq, ctx, error.code, error.message, error.retryable)

    def fail_with(self, seq: Sequence, ctx: Context, code: str, text: str, retry: bool) -> None:
        """``fail`` for an error that arrived as a message's fields (a refused reservation)."""
        self._counters.inc(f"failed_{code}")
        # A state that saw an error is never reused.
        self._end(seq, ctx, False, emission.failed(seq, code, text, retry))

    def _end(self, seq: Sequence, ctx: Context, detach: bool, terminal: Terminal) -> None:
        """After this nothing acts on the sequence; what it holds is released, then ``terminal``
        sent (a batched one's release waits for its state to leave the batch)."""
        seq.move(Phase.DONE)
        self._sequences.pop(seq.sequence_id, None)
        self._batches.ended(seq)
        self._gate.admit_waiting(ctx)
        if seq.batch_slot is not None:
            self._batches.leave_later(seq, detach)
            ctx.send(ROUTER, terminal)
        elif seq.in_compute:  # a decode step queued behind the last one still holds its state
            seq.abort.set()  # it does nothing if it has not started
            # It ends when that step is back, so that its terminal still means all is given back.
            seq.ending = Ending(detach, terminal)
        else:
            self.returned(seq, detach, ctx)
            ctx.send(ROUTER, terminal)
        self._followers_of(seq, terminal, ctx)

    def _followers_of(self, leader: Sequence, terminal: Terminal, ctx: Context) -> None:
        """The prewarms that follow ``leader`` end as it finished, or go on without it."""
        followers = [s for s in self._sequences.values() if s.leader is leader]
        if not followers:
            return
        if isinstance(terminal, SequenceFinished):  # its state is cached, or a request took it
            for seq in followers:
                # It computed nothing: what the cache now holds for it counts as cached.
                prewarmed = terminal.reason is FinishReason.PREWARMED
                seq.cached_tokens = seq.prefill_target if prewarmed else 0
                self.finish(seq, ctx, terminal.reason, keep=False)
        elif self._unloading:
            for seq in followers:
                self.abort(seq, "model_unloaded", ctx)
        else:
            self._gate.let_go(followers, ctx)

    def settle(self, seq: Sequence, ending: Ending, ctx: Context) -> None:
        """The step that held an ended sequence's state is back: give everything back, and only
        now send its terminal."""
        self.returned(seq, ending.detach, ctx)
        ctx.send(ROUTER, ending.terminal)

    def returned(self, seq: Sequence, detach: bool, ctx: Context) -> None:
        """An ended sequence's state is back (out of the batch, or from its last step): commit it
        if asked, then release what it holds."""
        if detach:
            self._detach(seq, ctx)
        seq.state = None
        self.release_holdings(seq, ctx)

    def _detach(self, seq: Sequence, ctx: Context) -> None:
        if self._backend is None:
            seq.state = None
            return
        self._entries.detach(seq, self._backend, ctx)

    def abandon_all(self, jobs: Iterable[Job], error: MlxRuntimeError, ctx: Context) -> None:
        """The engine gave up (its compute abandoned with ``jobs``): every sequence ends now, an
        aborted one ``Cancelled`` and the rest failing with ``error``; one that had ended while
        a job held its state sends its terminal as decided. Nothing is committed or released
        one by one: the engine releases its whole epoch next."""
        for job in jobs:
            held = job.seq if isinstance(job, StepJob) else None
            if held is not None and held.ending is not None:
                release_matcher(held)
                ctx.send(ROUTER, held.ending.terminal)
                held.ending = None
        for seq in list(self._sequences.values()):
            cancelled = seq.abort.is_set()
            seq.abort.set()  # a step still running on the abandoned thread gives up at its check
            release_matcher(seq)  # a step still using it fails at its next call, on that thread
            release_draft(seq)
            seq.move(Phase.DONE)
            if cancelled:
                self._counters.inc("cancelled")
                ctx.send(ROUTER, emission.cancelled(seq))
            else:
                self._counters.inc(f"failed_{error.code}")
                ctx.send(ROUTER, emission.failed(seq, error.code, error.message, error.retryable))
        self._sequences.clear()

    def release_holdings(self, seq: Sequence, ctx: Context) -> None:
        """Give back the sequence's prefix-cache lease, its KV reservation (snapshots too) and
        its constraint's grammar state."""
        release_matcher(seq)
        release_draft(seq)
        seq.snapshots.clear()  # those not in an entry: their bytes go back with the reservation
        if seq.lease_id is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
            seq.lease_id = None
        ctx.send(KV_KEEPER, Release(holder=seq.holder))
