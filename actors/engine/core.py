"""The engine actor: one per loaded model epoch; owns the model, its sequences and cached states.

Blocking model work runs as compute jobs on the engine's executor, one at a time. Between jobs the
core picks the next unit of work round-robin (a prefill chunk, a decode step, or a step of the
decode batch that ``BatchScheduler`` plans), so a sequence's abort flag is seen at the next chunk
or step boundary. Prefix entries' states live here; the
prefix-cache manager only indexes them, and the KV keeper only counts their bytes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from actors.engine.batch import BatchScheduler
from actors.engine.entries import EntryStore
from actors.engine.jobs import (
    Job,
    JobKind,
    StepPlan,
    run_batch,
    run_load,
    run_step,
    run_tokenize,
)
from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from runtime.backends.contract import Backend, BackendLoader, DecodeBatchHandle
from runtime.backends.options import EngineOptions, decode_options
from runtime.errors import (
    BackendError,
    ContextLengthExceeded,
    EngineCrashed,
    InvalidModelSpec,
    InvalidRequest,
    MlxRuntimeError,
    ModelLoadFailed,
)
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, ROUTER, Address, Context, engine_address
from runtime.kernel.stats import Counters
from runtime.messages import (
    Abort,
    Admit,
    Committed,
    ComputeDone,
    Drain,
    Drained,
    DropEntries,
    EndSession,
    EngineLoadFailed,
    EngineReady,
    EpochReleased,
    FinishReason,
    GetStats,
    Holder,
    HolderKind,
    InvalidateEpoch,
    Lookup,
    LookupResult,
    Message,
    ModelSpec,
    Release,
    ReleaseEpoch,
    ReleaseLease,
    RequestKind,
    ReservationRefused,
    Reserve,
    Reserved,
    ReusePath,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    SessionEnded,
    Stats,
    TokenLogprob,
    TokensProduced,
)
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.stop_strings import StopStringMatcher

log = logging.getLogger("mlx_actor_runtime.engine")


class EngineCore:
    """State and decisions of one engine (see module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        epoch: int,
        load_backend: BackendLoader,
        reservation_timeout_s: float = 30.0,
        default_max_tokens: int = 4096,
    ) -> None:
        self.model = spec.name
        self.epoch = epoch
        self._spec = spec
        self._load_backend = load_backend
        self._reservation_timeout_s = reservation_timeout_s
        self._default_max_tokens = default_max_tokens
        spec_error: InvalidModelSpec | None = None
        try:
            options: EngineOptions = decode_options(spec)
        except InvalidModelSpec as error:  # reported at start as the failed load; nothing runs
            options, spec_error = EngineOptions(), error
        self._plan = StepPlan(
            chunk_tokens=max(1, spec.prefill_chunk_tokens),
            checkpoint_every=options.checkpoint_every_tokens,
        )
        self._backend: Backend | None = None
        self._sequences: dict[int, Sequence] = {}
        self._next_job_id = 1
        self._jobs: dict[int, Job] = {}
        self._busy = False
        self._draining = False
        self._drain_requester: Address | None = None
        self._closed = False
        self._last_served = 0
        self._load_error: BaseException | None = spec_error
        self._max_concurrent = options.max_concurrent  # past the admission gate; others wait FIFO
        self._admission_queue: deque[Sequence] = deque()
        self.counters = Counters()
        self._entries = EntryStore(spec.name, epoch, self.counters)
        self._batches = BatchScheduler(spec.name, options, epoch, self.counters)

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, ctx: Context) -> None:
        if self._load_error is not None:  # the spec's options did not decode
            self._loaded(ctx)
            return
        job = Job(JobKind.LOAD)
        self._submit(ctx, job, lambda: run_load(job, self._load_backend, self._spec))

    def on_stop(self, ctx: Context) -> None:
        self._sequences.clear()
        self._entries.clear()

    def crashed(self, error: BaseException, ctx: Context) -> None:
        """Supervisor hook after a bug in ``handle``: fail every live sequence, keep the model.

        A sequence whose step is running fails when that step comes back (its state may be
        half-updated by the handler that crashed, so it is never committed).
        """
        message = f"engine crashed: {error!r}"
        for seq in list(self._sequences.values()):
            if seq.in_compute:
                seq.crash_message = message
                seq.abort.set()
            else:
                self._fail(seq, ctx, EngineCrashed.code, message, EngineCrashed.retryable)

    def statistics(self) -> Stats:
        gauges = {
            "sequences": len(self._sequences),
            **self._entries.gauges(),
            "batch_size": len(self._batches),
            "batch_padding_bytes": self._batches.padding_bytes,
        }
        return Stats(
            actor=engine_address(self.model, self.epoch),
            counters=self.counters.snapshot(),
            gauges=gauges,
        )

    @property
    def decode_batch(self) -> DecodeBatchHandle | None:
        """The decode batch, if one was opened (tests compare its real rows with the budget)."""
        return self._batches.handle

    # ------------------------------------------------------------------ messages

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        match message:
            case Admit():
                self._admit(message, ctx)
            case Abort(sequence_id=sequence_id, epoch=epoch, reason=reason):
                self._abort(sequence_id, epoch, reason, ctx)
            case ComputeDone(job_id=job_id):
                self._busy = False
                job = self._jobs.pop(job_id)
                self._job_done(job, ctx)
            case Reserved(holder=holder, nbytes=nbytes):
                self._reserved(holder, nbytes, ctx)
            case ReservationRefused(holder=holder, code=code, message=text, retryable=retry):
                seq = self._sequences.get(holder.id)
                if holder.kind is HolderKind.BATCH_PADDING:
                    self._batches.refused(holder, ctx)
                elif holder.kind is HolderKind.SEQUENCE and seq and seq.phase is Phase.RESERVING:
                    self._fail(seq, ctx, code, text, retry)
                elif holder.kind is HolderKind.PREFIX_ENTRY and self._entries.refused(holder.id):
                    pass  # no room for that snapshot: skipped
                else:
                    ctx.count_dead_letter("stale_reservation_reply")
            case LookupResult():
                self._looked_up(message, ctx)
            case Committed(entry_id=entry_id, accepted=accepted, superseded=superseded):
                dropped = superseded if accepted else (entry_id, *superseded)
                self._entries.drop(dropped, ctx)
            case EndSession(session=session, namespace=namespace):
                unpinned = self._entries.unpin((namespace, session), ctx)
                ctx.send(sender, SessionEnded(model=self.model, session=session, unpinned=unpinned))
            case DropEntries(epoch=epoch, entry_ids=ids) if epoch == self.epoch:
                self._entries.drop(ids, ctx)
            case Drain(epoch=epoch) if epoch == self.epoch:
                self._drain(sender, ctx)
            case EpochReleased(epoch=epoch) if epoch == self.epoch and self._draining:
                ctx.send(self._drain_requester or ROUTER, Drained(epoch=self.epoch))
            case GetStats():
                ctx.send(sender, self.statistics())
            case _:
                ctx.count_dead_letter("engine_unexpected_or_stale")
                self.counters.inc("stale_messages")
        self._pump(ctx)

    def _admit(self, admit: Admit, ctx: Context) -> None:
        if admit.epoch != self.epoch or self._draining:
            ctx.count_dead_letter("admit_to_stale_engine")
            return
        seq = Sequence.admitted(admit, self.model)
        self._sequences[seq.sequence_id] = seq
        self.counters.inc(f"admitted_{seq.kind}")
        if seq.tokens is not None and self._backend is not None:
            self._tokenized(seq, ctx)

    def _abort(self, sequence_id: int, epoch: int, reason: str, ctx: Context) -> None:
        seq = self._sequences.get(sequence_id)
        if epoch != self.epoch or seq is None:
            ctx.count_dead_letter("abort_unknown_sequence")
            self.counters.inc("aborts_noop")
            return
        self._request_abort(seq, reason, ctx)

    def _request_abort(self, seq: Sequence, reason: str, ctx: Context) -> None:
        if seq.abort.is_set():
            return
        seq.abort_reason = reason
        seq.abort.set()
        if not seq.in_compute:
            self._finish_cancelled(seq, ctx)

    # ------------------------------------------------------------------ admission steps

    def _tokenized(self, seq: Sequence, ctx: Context) -> None:
        assert seq.tokens is not None
        assert self._backend is not None
        info = self._backend.info
        if not seq.tokens:
            error = InvalidRequest(
                "the prompt is empty after tokenization; send at least one token"
            )
            self._fail_with(seq, ctx, error)
            return
        if seq.kind is RequestKind.GENERATE and seq.max_tokens == 0:  # "the rest of the context"
            room = info.context_length - len(seq.tokens)
            seq.max_tokens = max(1, min(room, self._default_max_tokens))
        wanted = len(seq.tokens) + (seq.max_tokens if seq.kind is RequestKind.GENERATE else 0)
        if wanted > info.context_length:
            error = ContextLengthExceeded(
                f"prompt ({len(seq.tokens)} tokens) plus max_tokens ({seq.max_tokens}) exceeds "
                f"the model's context of {info.context_length} tokens; shorten the prompt or "
                "lower max_tokens"
            )
            self._fail_with(seq, ctx, error)
            return
        seq.stop_token_ids = seq.stop_token_ids | info.eos_token_ids
        self._entries.plan_pin(seq, ctx)
        if seq.kind is RequestKind.GENERATE:
            self._supersede(seq, ctx)
        elif seq.prefill_target == 0:
            self._finish(seq, ctx, FinishReason.PREWARMED)
            return
        if self._running() >= self._max_concurrent:  # the admission gate: wait for a slot
            seq.phase = Phase.WAITING
            self._admission_queue.append(seq)
            self.counters.inc("admission_waits")
            return
        self._reserve(seq, ctx)

    def _running(self) -> int:
        """Sequences past the admission gate (reserving, looking up, computing)."""
        waiting = (Phase.TOKENIZING, Phase.WAITING)
        return sum(1 for s in self._sequences.values() if s.phase not in waiting)

    def _admit_waiting(self, ctx: Context) -> None:
        while self._admission_queue and self._running() < self._max_concurrent:
            seq = self._admission_queue.popleft()
            if seq.phase is Phase.WAITING:  # not cancelled while it waited
                self._reserve(seq, ctx)

    def _reserve(self, seq: Sequence, ctx: Context) -> None:
        assert seq.tokens is not None
        assert self._backend is not None
        wanted = len(seq.tokens) + (seq.max_tokens if seq.kind is RequestKind.GENERATE else 0)
        seq.phase = Phase.RESERVING
        ctx.send(
            KV_KEEPER,
            Reserve(
                holder=seq.holder,
                nbytes=self._backend.info.kv_bytes(wanted, self._plan.chunk_tokens),
                timeout_s=self._reservation_timeout_s,
            ),
        )

    def _supersede(self, seq: Sequence, ctx: Context) -> None:
        """A generate adopts an in-flight prewarm it extends and aborts others in its session.

        With ``supersede`` set (the keystroke case) it also aborts the session's older generates.
        """
        assert seq.tokens is not None
        for other in list(self._sequences.values()):
            if other is seq or other.session != seq.session:
                continue
            if other.abort.is_set() or other.phase is Phase.DONE:
                continue
            if other.kind is RequestKind.GENERATE:
                if seq.supersede:
                    self._request_abort(other, "superseded", ctx)
                    self.counters.inc("generates_superseded")
                continue
            target = other.tokens[: other.prefill_target] if other.tokens else None
            extends = target is not None and seq.tokens[: len(target)] == target
            if extends and other.phase in COMPUTE_PHASES and seq.resume_phase is None:
                self._adopt(seq, other, ctx)
            else:
                self._request_abort(other, "superseded", ctx)
                self.counters.inc("prewarms_superseded")

    def _adopt(self, seq: Sequence, prewarm: Sequence, ctx: Context) -> None:
        seq.state, prewarm.state = prewarm.state, None
        seq.lease_id, prewarm.lease_id = prewarm.lease_id, None
        seq.checkpoints, prewarm.checkpoints = prewarm.checkpoints, []
        seq.snapshot_ids, prewarm.snapshot_ids = prewarm.snapshot_ids, []
        seq.generation = prewarm.generation
        seq.restore_entry, seq.restore_length = prewarm.restore_entry, prewarm.restore_length
        seq.in_compute, prewarm.in_compute = prewarm.in_compute, False
        seq.resume_phase = prewarm.phase
        seq.path = ReusePath.ADOPTED
        prewarm.adopted_by = seq
        self.counters.inc("prewarms_adopted")
        self._finish(prewarm, ctx, FinishReason.ADOPTED)

    def _reserved(self, holder: Holder, nbytes: int, ctx: Context) -> None:
        if holder.kind is HolderKind.PREFIX_ENTRY:
            self._entries.reserved(holder.id, ctx)
            return
        if holder.kind is HolderKind.BATCH_PADDING:
            self._batches.reserved(holder, nbytes, ctx)
            return
        seq = self._sequences.get(holder.id)
        if (
            holder.kind is not HolderKind.SEQUENCE
            or seq is None
            or seq.phase is not Phase.RESERVING
        ):
            ctx.send(KV_KEEPER, Release(holder=holder))  # its sequence ended while it waited
            ctx.count_dead_letter("stale_reservation_reply")
            return
        seq.reserved = True
        if seq.resume_phase is not None:
            seq.phase = seq.resume_phase
            if seq.phase is Phase.PREFILLING and not seq.in_compute:
                self._announce_start(seq, ctx)
                self._after_prefill_chunk(seq, ctx)
            return
        seq.phase = Phase.LOOKING_UP
        assert seq.tokens is not None
        ctx.send(
            PREFIX_CACHE,
            Lookup(
                model=self.model,
                epoch=self.epoch,
                namespace=seq.namespace,
                tokens=seq.tokens,
                sequence_id=seq.sequence_id,
            ),
        )

    def _looked_up(self, result: LookupResult, ctx: Context) -> None:
        seq = self._sequences.get(result.sequence_id)
        if result.epoch != self.epoch or seq is None or seq.phase is not Phase.LOOKING_UP:
            if result.lease_id is not None:
                ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=result.lease_id))
            ctx.count_dead_letter("stale_lookup_result")
            return
        seq.lease_id, seq.generation = result.lease_id, result.generation
        entry_id, matched, path = result.entry_id, result.matched, result.path
        if entry_id is not None and entry_id not in self._entries:
            self.counters.inc("fallback_entry_missing")
            entry_id, matched, path = None, 0, ReusePath.MISS
            if seq.lease_id is not None:  # nothing of it is used: let it be evicted
                ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
                seq.lease_id = None
        if seq.kind is RequestKind.PREWARM and matched >= seq.prefill_target:
            self.counters.inc("prewarms_already_warm")
            self._finish(seq, ctx, FinishReason.PREWARMED)
            return
        seq.restore_entry, seq.restore_length = entry_id, matched
        seq.cached_tokens, seq.path = matched, path
        seq.phase = Phase.RESTORING

    def _announce_start(self, seq: Sequence, ctx: Context) -> None:
        """Tell the router how the prompt state was obtained, once that is final (after restore)."""
        assert seq.tokens is not None
        assert seq.state is not None
        if seq.started_sent:
            return
        seq.started_sent = True
        if seq.path is ReusePath.ADOPTED:
            seq.cached_tokens = seq.state.length  # what the prewarm had computed when it ended
        self.counters.inc(f"path_{seq.path}")
        log.debug("sequence %d: %s, %d of %d prompt tokens reused", seq.sequence_id, seq.path,
                  seq.cached_tokens, len(seq.tokens))  # fmt: skip
        self.counters.inc("cached_prompt_tokens", seq.cached_tokens)
        ctx.send(
            ROUTER,
            SequenceStarted(
                sequence_id=seq.sequence_id,
                epoch=self.epoch,
                prompt_tokens=len(seq.tokens),
                cached_tokens=seq.cached_tokens,
                path=seq.path,
                dropped_turns=seq.dropped_turns,
            ),
        )

    # ------------------------------------------------------------------ compute

    def _pump(self, ctx: Context) -> None:
        """Start the next compute job if the executor is free."""
        if self._busy or self._closed or self._backend is None:
            return
        backend = self._backend
        waiting = [s for s in self._sequences.values() if s.phase is Phase.TOKENIZING]
        if waiting:
            job = Job(JobKind.TOKENIZE)
            self._submit(ctx, job, lambda: run_tokenize(job, waiting, backend))
            return
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
        batch_now = self._batches.takes_turn(work, bool(ready))
        if work is not None and batch_now:
            for seq in (*work.leavers, *work.joiners, *work.members):
                seq.in_compute = True
            job = Job(JobKind.BATCH, work=work)
            batch = self._batches.handle
            self._submit(ctx, job, lambda: run_batch(job, work, backend, batch))
            return
        if ready:
            seq = ready[0]
            self._last_served = seq.sequence_id
            seq.in_compute = True
            step = Job(JobKind.STEP, seq=seq)
            # Leased: never dropped meanwhile.
            source = self._entries.restore_source(seq.restore_entry, seq.restore_length)
            self._submit(ctx, step, lambda: run_step(step, seq, backend, self._plan, source))
            return
        if self._draining and not self._sequences and not self._batches.has_leaving:
            self._closed = True
            backend, self._backend = self._backend, None
            self._batches.handle = None
            self._submit(ctx, Job(JobKind.CLOSE), backend.close)

    def _submit(self, ctx: Context, job: Job, work: Callable[[], None]) -> None:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = job
        self._busy = True
        ctx.compute(work, ComputeDone(job_id=job_id))

    def _job_done(self, job: Job, ctx: Context) -> None:
        match job.kind:
            case JobKind.LOAD:
                self._backend, self._load_error = job.backend, job.error
                if job.backend is not None:
                    self._batches.loaded(job.backend.info, job.batchable)
                self._loaded(ctx)
            case JobKind.TOKENIZE:
                self._tokenize_done(job, ctx)
            case JobKind.CLOSE:
                self._closed_down(ctx)
            case JobKind.STEP:
                assert job.seq is not None
                self._step_done(job, job.seq.live_successor(), ctx)
            case JobKind.BATCH:
                self._batch_done(job, ctx)

    def _step_done(self, job: Job, seq: Sequence, ctx: Context) -> None:
        seq.in_compute = False
        self.counters.inc(
            "decoded_tokens" if seq.phase is Phase.DECODING else "prefilled_tokens", job.prefilled
        )
        if job.fallback is not None:
            self._fall_back_cold(seq, job.fallback, ctx)
        if job.state is not None:
            seq.state = job.state
        if job.checkpoints is not None:
            seq.checkpoints = job.checkpoints
        if job.pin_copy is not None or job.snapshot is not None:
            seq.checkpoints.pop(0)  # the chunk landed on it: one of the two was taken there
        if job.pin_copy is not None:
            assert self._backend is not None
            self._entries.pin_copy(seq, job.pin_copy, self._backend, ctx)
        if job.snapshot is not None:
            self._entries.snapshot(seq, job.snapshot, ctx)
        if seq.phase is Phase.DONE:
            return
        if seq.crash_message is not None:
            self._fail(seq, ctx, EngineCrashed.code, seq.crash_message, EngineCrashed.retryable)
            return
        if seq.abort.is_set() or job.skipped:
            self._finish_cancelled(seq, ctx)
            return
        if isinstance(job.error, MlxRuntimeError):  # e.g. a logit bias outside the vocabulary
            self._fail_with(seq, ctx, job.error)
            return
        if job.error is not None:
            self._fail_with(seq, ctx, BackendError(f"model step failed: {job.error!r}"))
            return
        if seq.phase is Phase.RESERVING:  # adopted mid-step; it resumes once reserved
            if seq.resume_phase is Phase.RESTORING:
                seq.resume_phase = Phase.PREFILLING
            return
        if seq.phase is Phase.RESTORING:
            seq.phase = Phase.PREFILLING
        if seq.phase is Phase.PREFILLING:
            self._announce_start(seq, ctx)
            self._after_prefill_chunk(seq, ctx)
        elif seq.phase is Phase.DECODING:
            self._after_decode_step(seq, job, ctx)

    def _batch_done(self, job: Job, ctx: Context) -> None:
        done = self._batches.done(job, ctx)
        for seq, leaving in done.returned:
            if leaving is None:  # aborted while it waited for this step
                self._finish_cancelled(seq, ctx)
            elif not leaving.resume:
                if leaving.detach:
                    self._detach(seq, ctx)
                self._release_holdings(seq, ctx)
        if job.error is not None:
            error = BackendError(f"batched decode step failed: {job.error!r}")
            for seq in done.failed:
                self._fail_with(seq, ctx, error)
            for seq in done.orphaned:
                self._release_holdings(seq, ctx)
        for seq, step in done.stepped:
            self._step_done(step, seq, ctx)
        for seq in self._sequences.values():
            seq.in_compute = False  # joiners that were aborted before joining, or never got in

    def _fall_back_cold(self, seq: Sequence, reason: str, ctx: Context) -> None:
        self.counters.inc(f"fallback_{reason}")  # before Started: nothing was counted as reused
        log.debug("sequence %d: reuse fell back to a cold prefill (%s)", seq.sequence_id, reason)
        seq.cached_tokens, seq.path = 0, ReusePath.MISS
        if seq.lease_id is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
            seq.lease_id = None

    def _loaded(self, ctx: Context) -> None:
        if self._backend is None:
            error = self._load_error
            code = error.code if isinstance(error, MlxRuntimeError) else ModelLoadFailed.code
            ctx.send(ROUTER, EngineLoadFailed(epoch=self.epoch, code=code, message=str(error)))
            self._closed = True
            return
        info = self._backend.info
        log.info("model %s (epoch %d): prefix reuse path %s: %s",
                 self.model, self.epoch, info.reuse, info.reuse_reason)  # fmt: skip
        ctx.send(
            ROUTER,
            EngineReady(
                epoch=self.epoch,
                reuse_path=str(info.reuse),
                bytes_per_token=info.bytes_per_token,
                context_length=info.context_length,
            ),
        )
        for seq in list(self._sequences.values()):
            if seq.tokens is not None and seq.phase is Phase.TOKENIZING:
                self._tokenized(seq, ctx)

    def _tokenize_done(self, job: Job, ctx: Context) -> None:
        # Only the sequences this job tokenized: others admitted meanwhile wait for the next one.
        for seq_id in [*job.results, *job.failures]:
            seq = self._sequences.get(seq_id)
            if seq is None or seq.phase is not Phase.TOKENIZING or seq.tokens is not None:
                continue
            failure = job.failures.get(seq.sequence_id)
            tokens = job.results.get(seq.sequence_id)
            if isinstance(failure, MlxRuntimeError):  # bad chat input, context overflow
                self._fail_with(seq, ctx, failure)
            elif tokens is None:
                error = InvalidRequest(f"the prompt could not be tokenized: {failure!r}")
                self._fail_with(seq, ctx, error)
            else:
                prepared = job.prepared.get(seq.sequence_id)
                if prepared is not None:
                    seq.instructions_tokens = prepared.instructions_tokens
                    seq.dropped_turns = prepared.dropped_turns
                seq.tokens = tuple(tokens)
                self._tokenized(seq, ctx)

    def _closed_down(self, ctx: Context) -> None:
        """Compute has stopped for good: forget every entry and hand the epoch's memory back."""
        self._entries.clear()
        ctx.send(PREFIX_CACHE, InvalidateEpoch(model=self.model, epoch=self.epoch))
        ctx.send(KV_KEEPER, ReleaseEpoch(model=self.model, epoch=self.epoch))
        # Drained waits for EpochReleased: "unloaded" must mean the memory is free.

    def _after_prefill_chunk(self, seq: Sequence, ctx: Context) -> None:
        assert seq.state is not None
        if seq.state.length < seq.prefill_target:
            return
        if seq.kind is RequestKind.PREWARM:
            self._finish(seq, ctx, FinishReason.PREWARMED)
            return
        assert self._backend is not None
        seq.phase = Phase.DECODING
        seq.detokenizer = IncrementalDetokenizer(self._backend.decode)
        if seq.stop_strings:
            seq.stop_matcher = StopStringMatcher(seq.stop_strings)

    def _after_decode_step(self, seq: Sequence, job: Job, ctx: Context) -> None:
        assert job.token is not None
        matcher = seq.stop_matcher
        if job.token in seq.stop_token_ids:  # EOS or a stop token: not emitted, not counted
            tail, stop = job.text, None
            if matcher is not None:  # the last text may itself complete a stop string
                ended = matcher.feed(job.text)
                tail = ended.text if ended.stopped else ended.text + matcher.flush()
                stop = ended.stop
            self._emit(seq, (), tail, ctx)
            self._finish(seq, ctx, FinishReason.STOP, stop=stop)
            return
        seq.generated.append(job.token)
        seq.pending_token = job.token
        result = matcher.feed(job.text) if matcher else None
        logprobs = () if job.logprob is None else (job.logprob,)
        if result is not None and result.stopped:
            self._emit(seq, (job.token,), result.text, ctx, logprobs)
            self._finish(seq, ctx, FinishReason.STOP, stop=result.stop)
            return
        text = job.text if result is None else result.text
        last = len(seq.generated) >= seq.max_tokens
        if last and matcher is not None:
            text += matcher.flush()
        self._emit(seq, (job.token,), text, ctx, logprobs)
        if last:
            self._finish(seq, ctx, FinishReason.LENGTH)

    def _emit(
        self,
        seq: Sequence,
        token_ids: tuple[int, ...],
        text: str,
        ctx: Context,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        if not token_ids and not text:
            return
        produced = TokensProduced(
            sequence_id=seq.sequence_id,
            epoch=self.epoch,
            token_ids=token_ids,
            text=text,
            logprobs=logprobs,
        )
        ctx.send(ROUTER, produced)

    # ------------------------------------------------------------------ endings

    def _finish(
        self, seq: Sequence, ctx: Context, reason: FinishReason, stop: str | None = None
    ) -> None:
        self._end(seq, ctx, detach=reason is not FinishReason.ADOPTED)
        self.counters.inc(f"finished_{reason}")
        message = SequenceFinished(
            sequence_id=seq.sequence_id,
            epoch=self.epoch,
            reason=reason,
            usage=seq.usage(),
            stop=stop,
        )
        ctx.send(ROUTER, message)

    def _finish_cancelled(self, seq: Sequence, ctx: Context) -> None:
        # An aborted prefill is not wasted: its cache is kept (unless the model is going away).
        self._end(seq, ctx, detach=not self._draining)
        self.counters.inc("cancelled")
        ctx.send(
            ROUTER,
            SequenceCancelled(
                sequence_id=seq.sequence_id,
                epoch=self.epoch,
                usage=seq.usage(),
                reason=seq.abort_reason,
            ),
        )

    def _fail_with(self, seq: Sequence, ctx: Context, error: MlxRuntimeError) -> None:
        self._fail(seq, ctx, error.code, error.message, error.retryable)

    def _fail(self, seq: Sequence, ctx: Context, code: str, text: str, retry: bool) -> None:
        seq.state = None  # a state that saw an error is never reused
        self._end(seq, ctx, detach=False)
        self.counters.inc(f"failed_{code}")
        ctx.send(
            ROUTER,
            SequenceFailed(
                sequence_id=seq.sequence_id,
                epoch=self.epoch,
                code=code,
                message=text,
                retryable=retry,
                usage=seq.usage(),
            ),
        )

    def _end(self, seq: Sequence, ctx: Context, detach: bool) -> None:
        """After this nothing acts on the sequence; what it holds is released (a batched one's
        once its state is back out of the batch)."""
        seq.phase = Phase.DONE
        self._sequences.pop(seq.sequence_id, None)
        self._batches.ended(seq)
        self._admit_waiting(ctx)
        if seq.batch_slot is not None:
            self._batches.leave_later(seq, detach)
            return
        if detach:
            self._detach(seq, ctx)
        seq.state = None
        self._release_holdings(seq, ctx)

    def _detach(self, seq: Sequence, ctx: Context) -> None:
        if self._backend is None:
            seq.state = None
            return
        self._entries.detach(seq, self._backend, ctx)

    def _release_holdings(self, seq: Sequence, ctx: Context) -> None:
        self._entries.discard_snapshots(seq, ctx)
        if seq.lease_id is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
            seq.lease_id = None
        ctx.send(KV_KEEPER, Release(holder=seq.holder))

    # ------------------------------------------------------------------ teardown

    def _drain(self, requester: Address, ctx: Context) -> None:
        if self._draining:
            return
        self._draining = True
        self._drain_requester = requester
        for seq in list(self._sequences.values()):
            self._request_abort(seq, "model_unloaded", ctx)
        if self._closed and not self._busy:  # the load had failed: nothing to stop
            self._closed_down(ctx)
