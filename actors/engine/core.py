"""The engine actor: one per loaded model epoch; owns the model, its sequences and cached states.

The core is the mailbox and the model's own life: it loads the model, hands it to the parts that
use it, drains, closes, and gives up (a crash in ``handle``, or a step past ``step_timeout_s``:
every sequence ends, the epoch is released, the router reloads the model). Each part has one job:
admission.py and gate.py take a sequence to its first compute job, stepping.py runs one step
(plan.py decides it, compute.py runs it, outcomes.py applies it), endings.py ends sequences, and
lifecycle.py is the table of phases every change goes through. Prefix entries' states live here
(entries.py); the prefix-cache manager only indexes them. See docs/design.md.
"""

from __future__ import annotations

import logging
from typing import assert_never

from actors.engine import reports
from actors.engine.assembly import EngineParts
from actors.engine.checkpoints import CheckpointPolicy
from actors.engine.disk_tier import ExportJob, ReadJob, run_export
from actors.engine.draft_model import DraftModel, close_models, default_drafts
from actors.engine.gate import AdmissionLimits
from actors.engine.jobs import CloseJob, Job, LoadJob, ProbeJob, run_load
from actors.engine.retirement import Retirement
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import (
    Backend,
    BackendLoader,
    DecodeBatchHandle,
    ModelInfo,
    SequenceState,
)
from runtime.backends.disk import DiskCacheConfig
from runtime.backends.options import EngineOptions, ModelOptions, decode_options
from runtime.errors import EngineCrashed, InvalidModelSpec, MlxRuntimeError, ModelLoadFailed
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, ROUTER, Address, Context, engine_address
from runtime.kernel.stats import Counters
from runtime.messages import (
    Abort,
    Admit,
    Committed,
    ComputeDone,
    ComputeWatch,
    DiskDone,
    Drain,
    Drained,
    DropEntries,
    EndSession,
    EngineInbox,
    EngineLoadFailed,
    EngineProbed,
    EpochReleased,
    GetStats,
    HolderKind,
    InvalidateEpoch,
    LookupResult,
    Message,
    ModelSpec,
    ReleaseEpoch,
    ReservationRefused,
    Reserved,
    ResetPrefixes,
    SessionEnded,
    Stats,
    TidyDue,
)
from runtime.text.constraints import live_matchers

log = logging.getLogger("mlx_actor_runtime.engine")


class EngineCore:
    """State and decisions of one engine (see module docstring); it owns the table of live
    sequences, shared with its parts (assembly.py)."""

    def __init__(
        self,
        spec: ModelSpec,
        epoch: int,
        load_backend: BackendLoader,
        kv_budget_bytes: int,
        reservation_timeout_s: float = 30.0,
        default_max_tokens: int = 4096,
        step_timeout_s: float | None = None,
        strict_max_tokens: bool = False,
        disk: DiskCacheConfig | None = None,
    ) -> None:
        self.model = spec.name
        self.epoch = epoch
        self._spec = spec
        self._load_backend = load_backend
        # Decoded once here; the backend loads with these (run_load), never decoding them again.
        self._options: ModelOptions | InvalidModelSpec
        try:
            self._options = decode_options(spec)
        except InvalidModelSpec as error:  # reported at start as the failed load; nothing runs
            self._options = error
        options = self._options if isinstance(self._options, EngineOptions) else EngineOptions()
        # The most a chunk holds (KV is priced with it).
        chunk_tokens = max(1, spec.prefill_chunk_tokens or options.chunk_tokens)
        self._backend: Backend | None = None
        self._draft: DraftModel | None = None  # the model's draft model, from its load on
        # The info the model runs by (its load, then a deferred probe): statistics() shows its
        # verdicts (capability_* gauges, 1 on, 0 off) and the off ones' whys (limits).
        self._info: ModelInfo | None = None
        self._sequences: dict[int, Sequence] = {}
        self._draining = False
        self._drain_requester: Address | None = None
        self._closed = False
        self._retired: Retirement | None = None  # set once it gave up (a crash, a stuck step)
        self.counters = Counters()
        self._kv_budget_bytes = kv_budget_bytes
        limits = AdmissionLimits(
            options.max_concurrent,  # past the admission gate; others wait FIFO
            reservation_timeout_s,
            default_max_tokens,
            chunk_tokens,
            CheckpointPolicy(options.checkpoint_every_tokens, kv_budget_bytes),
            strict_max_tokens,
            default_drafts(spec, options),
            options.lookup_with_reserve,
        )
        p = EngineParts.build(
            spec.name, epoch, options, self._sequences, self.counters, limits, disk,
            kv_budget_bytes, step_timeout_s,
        )  # fmt: skip
        self._entries, self._disk, self._batches = p.entries, p.disk, p.batches
        self._probing, self._tidying, self._sizer = p.probing, p.tidying, p.sizer
        self._compute, self._gate, self._ends = p.compute, p.gate, p.ends
        self._admission, self._outcomes, self._step = p.admission, p.outcomes, p.step

    # ------------------------------------------------------------------ lifecycle

    def on_start(self, ctx: Context) -> None:
        options = self._options
        if isinstance(options, InvalidModelSpec):  # the spec's options did not decode
            self._loaded(LoadJob(error=options), ctx)
            return
        job = LoadJob()

        def load() -> None:
            run_load(job, self._load_backend, self._spec, options)
            if job.backend is not None:  # its index is ready before the first lookup
                job.disk = self._disk.open(job.backend)

        self._compute.submit(ctx, job, load)

    def on_stop(self, ctx: Context) -> None:
        self._sequences.clear()
        self._entries.clear()

    def crashed(self, error: BaseException, ctx: Context) -> None:
        """Supervisor hook after a bug in ``handle``: the engine gives up, as after a stuck step
        (``_give_up``); the router reloads the model at a new epoch."""
        text = (
            f"the engine of model {self.model!r} crashed ({error!r}); it is restarted with its "
            "model reloaded: retry the request"
        )
        self._give_up(EngineCrashed(text), ctx)

    def statistics(self) -> Stats:
        gauges = {
            **reports.sequence_gauges(self._sequences.values()),
            **self._entries.gauges(),
            "batch_size": len(self._batches),
            "batch_padding_bytes": self._batches.padding_bytes,
            # Process-wide (every model's): grammar states not released yet; 0 when none is live.
            "live_matchers": live_matchers(),
            **reports.capability_gauges(self._info),
            "probe_pending": int(self._probing.pending),
            **self._disk.gauges(),
            # Draft-model states held by sequences (0 once every sequence has ended).
            "draft_states": 0 if self._draft is None else self._draft.live,
            # The budget it plans against (checkpoints): its node's, on a Ray node.
            "kv_budget_bytes": self._kv_budget_bytes,
        }
        return Stats(
            actor=engine_address(self.model, self.epoch),
            counters=self.counters.snapshot(),
            gauges=gauges,
            limits=self._info.limits if self._info else {},
        )

    @property
    def drain_requester(self) -> Address | None:
        """Who asked this engine to drain, if anyone (what a lost process's stand-in answers)."""
        return self._drain_requester if self._draining else None

    @property
    def decode_batch(self) -> DecodeBatchHandle | None:
        """The decode batch, if one was opened (tests compare its real rows with the budget)."""
        return self._batches.handle

    def sequence(self, sequence_id: int) -> Sequence | None:
        """A live sequence, read only (tests check what it holds and when it emits)."""
        return self._sequences.get(sequence_id)

    def entry_state(self, entry_id: int) -> SequenceState | None:
        """The cached state of prefix entry ``entry_id``, read only (tests match it to its key)."""
        return self._entries.state(entry_id)

    # ------------------------------------------------------------------ messages

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        # The transport delivers any message; what is not engine mail is dropped and counted.
        if self._retired is not None:  # only its end is still to report
            self._retired.handle(message, sender, ctx, self.statistics, self.counters)
            return
        if isinstance(message, EngineInbox):
            self._receive(message, sender, ctx)
        else:
            self._count_stale(ctx)
        self._pump(ctx)

    def _receive(self, message: EngineInbox, sender: Address, ctx: Context) -> None:
        match message:
            case Admit(epoch=epoch) if epoch == self.epoch and not self._draining:
                self._admission.admit(message, ctx)
            case Admit():  # for another load of the model, or too late: this one is draining
                ctx.count_dead_letter("admit_to_stale_engine")
            case Abort(sequence_id=sequence_id, epoch=epoch, reason=reason) if (
                epoch == self.epoch and sequence_id in self._sequences
            ):
                self._ends.abort(self._sequences[sequence_id], reason, ctx)
            case Abort():  # the sequence already ended, or belongs to another load
                ctx.count_dead_letter("abort_unknown_sequence")
                self.counters.inc("aborts_noop")
            case ComputeDone(job_id=job_id):
                self._job_done(self._compute.done(job_id, ctx), ctx)
            case TidyDue():
                if not self._tidying.timer(message):
                    ctx.count_dead_letter("stale_tidy_timer")
            case ComputeWatch():
                if self._compute.overdue(ctx):
                    self._give_up(self._compute.overran(self.model), ctx)
            case Reserved(holder=holder, nbytes=nbytes):
                if holder.kind is HolderKind.PREFIX_ENTRY:
                    self._entries.reserved(holder.id, ctx)
                elif holder.kind is HolderKind.BATCH_PADDING:
                    self._batches.reserved(holder, nbytes, ctx)
                elif (adopter := self._admission.reserved(holder, ctx)) is not None:
                    self._outcomes.prefill_advanced(adopter, ctx)
            case ReservationRefused(holder=holder, code=code, message=text, retryable=retry):
                seq = self._sequences.get(holder.id)
                if holder.kind is HolderKind.BATCH_PADDING:
                    self._batches.refused(holder, ctx)
                elif holder.kind is HolderKind.SEQUENCE and seq and seq.phase is Phase.RESERVING:
                    self._ends.fail_with(seq, ctx, code, text, retry)
                elif holder.kind is HolderKind.PREFIX_ENTRY and self._entries.refused(holder.id):
                    pass  # no room for that pinned copy: skipped
                else:
                    ctx.count_dead_letter("stale_reservation_reply")
            case LookupResult():
                self._admission.looked_up(message, ctx)
            case Committed(entry_id=entry_id, accepted=accepted, superseded=superseded):
                dropped = superseded if accepted else (entry_id, *superseded)
                self._entries.drop(dropped, ctx)
                if accepted and (kept := self._entries.to_keep_on_disk(entry_id)) is not None:
                    self._disk.spill([kept], lambda job: self._export(job, ctx))
            case EndSession(session=session, namespace=namespace):
                unpinned = self._entries.unpin((namespace, session), ctx)
                ctx.send(sender, SessionEnded(model=self.model, session=session, unpinned=unpinned))
            case DropEntries(epoch=epoch, entry_ids=ids, spill=spill) if epoch == self.epoch:
                evicted = self._entries.drop(ids, ctx)
                if spill:
                    self._disk.spill(evicted, lambda job: self._export(job, ctx))
            case ResetPrefixes(namespace=namespace):  # the router's copy: the disk tier's part
                self._disk.forget(namespace, ctx)
            case DiskDone():
                job = self._disk.done(message)
                if isinstance(job, ReadJob):
                    self._disk.loaded_back(job, self._sequences.get(job.sequence_id), ctx)
            case Drain(epoch=epoch) if epoch == self.epoch:
                self._drain(sender, ctx)
            case EpochReleased(epoch=epoch) if epoch == self.epoch and self._draining:
                ctx.send(self._drain_requester or ROUTER, Drained(epoch=self.epoch))
            case DropEntries() | Drain() | EpochReleased():  # another load's, or not waited for
                self._count_stale(ctx)
            case GetStats():
                ctx.send(sender, self.statistics())
            case _:
                assert_never(message)

    def _count_stale(self, ctx: Context) -> None:
        ctx.count_dead_letter("engine_unexpected_or_stale")
        self.counters.inc("stale_messages")

    # ------------------------------------------------------------------ compute

    def _pump(self, ctx: Context) -> None:
        """Start the next step (stepping.py); once drained, close the model."""
        if self._closed or self._backend is None:
            return
        if self._step.start(self._backend, ctx, idle_work=not self._draining):
            return
        if self._draining and not self._sequences and not self._batches.has_leaving:
            if not self._disk.flushed:  # a clean unload keeps what RAM holds, if it can
                self._disk.flush(self._entries.kept(), lambda job: self._export(job, ctx))
            if self._disk.busy or self._compute.busy:
                return
            self._closed = True
            backend, draft, self._backend = self._backend, self._draft, None
            self._hand_over(None, None)
            self._batches.handle = None
            self._compute.submit(ctx, CloseJob(), lambda: close_models(backend, draft))

    def _export(self, job: ExportJob, ctx: Context) -> None:
        backend = self._backend
        assert backend is not None
        self._compute.submit(ctx, job, lambda: run_export(job, backend))

    # ------------------------------------------------------------------ finished jobs

    def _job_done(self, job: Job, ctx: Context) -> None:
        match job:
            case LoadJob():
                self._loaded(job, ctx)
            case CloseJob():
                self._closed_down(ctx)
            case ProbeJob():
                if (info := self._probing.done(job)) is not None:
                    self._probed(info, job.batchable, ctx)
            case _:  # a sequence's job, or idle work's
                self._step.apply(job, ctx)

    def _loaded(self, job: LoadJob, ctx: Context) -> None:
        self._backend = job.backend
        if job.backend is None:
            error = job.error
            code = error.code if isinstance(error, MlxRuntimeError) else ModelLoadFailed.code
            ctx.send(ROUTER, EngineLoadFailed(epoch=self.epoch, code=code, message=str(error)))
            self._closed = True
            return
        info = job.backend.info
        self._batches.loaded(info, job.batchable)
        self._sizer.loaded(info.pass_s, info.stop_checks)
        self._probing.loaded(job.probe)
        # Debug: the router logs the load's one info line (actors/model_lifecycle.py).
        log.debug("model %s (epoch %d): prefix reuse path %s: %s",
                 self.model, self.epoch, info.reuse, info.reuse_reason)  # fmt: skip
        self._info = info
        ctx.send(ROUTER, reports.ready(self.epoch, info))
        self._hand_over(job.backend, job.draft)
        self._gate.loaded(info, job.draft)
        self._admission.loaded(info, ctx)
        self._disk.opened(job.disk, job.backend)

    def _hand_over(self, backend: Backend | None, draft: DraftModel | None) -> None:
        """The model (and its draft model) to the parts that use it: given once at the load,
        taken back at the close or when the engine gives up."""
        self._draft = draft
        self._ends.loaded(backend)
        self._outcomes.loaded(backend, draft)

    def _probed(self, info: ModelInfo, batchable: bool, ctx: Context) -> None:
        """The deferred load probe gave its verdict: from now on the model runs by ``info``."""
        self._batches.loaded(info, batchable)
        self._gate.loaded(info, self._draft)
        self._admission.probed(info)
        self._info = info
        ctx.send(
            ROUTER, EngineProbed(epoch=self.epoch, reuse_path=str(info.reuse), limits=info.limits)
        )

    def _closed_down(self, ctx: Context) -> None:
        """Compute has stopped for good: forget every entry and hand the epoch's memory back."""
        self._entries.clear()
        ctx.send(PREFIX_CACHE, InvalidateEpoch(model=self.model, epoch=self.epoch))
        ctx.send(KV_KEEPER, ReleaseEpoch(model=self.model, epoch=self.epoch))
        # Drained waits for EpochReleased: "unloaded" must mean the memory is free.

    # ------------------------------------------------------------------ giving up

    def _give_up(self, error: MlxRuntimeError, ctx: Context) -> None:
        """Retire this engine at once: its compute is abandoned (a stuck thread cannot be
        killed), every sequence ends now (``error``, retryable; an aborted one ``Cancelled``),
        its prefix entries are forgotten and its epoch's memory released; once the keeper
        confirms, the router hears ``EngineFailed`` (or ``Drained``, if it asked for a drain)."""
        if self._retired is not None:
            return
        requester = (self._drain_requester or ROUTER) if self._draining else None
        self._retired = Retirement(self.epoch, error, requester)
        log.error("model %s (epoch %d): the engine gives up: %s", self.model, self.epoch, error)
        ctx.abandon_compute()
        self._ends.abandon_all(self._compute.abandon(), error, ctx)
        self._batches.handle = None
        self._backend = None  # left to the abandoned thread; no close job can run after it
        self._hand_over(None, self._draft)
        self._closed = True
        self._closed_down(ctx)

    # ------------------------------------------------------------------ teardown

    def _drain(self, requester: Address, ctx: Context) -> None:
        if self._draining:
            return
        self._draining = True
        self._ends.unloading()
        self._drain_requester = requester
        for seq in list(self._sequences.values()):
            self._ends.abort(seq, "model_unloaded", ctx)
        if self._closed and not self._compute.busy:  # the load had failed: nothing to stop
            self._closed_down(ctx)
