"""Continuous batching inside one engine: who decodes in the shared batch, and its padding's bytes.

One decoding sequence runs alone on the B=1 fast path; two or more share one decode batch. A
sequence joins at the next batch step after its first token and leaves at the next step after it
ended (its state must come out before its memory is released) or when the batch drains to one. The
batch's left padding, which no reservation pays for, is held under one ``BATCH_PADDING`` holder per
batch. A step that raised fails its members; a newcomer it left out never asks to join again, so
nothing livelocks. The scheduler reports; the engine ends sequences.

See docs/design.md, "Fast path and continuous batching".
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from actors.engine.jobs import BatchJob, BatchWork, StepJob
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import DecodeBatchHandle, ModelInfo
from runtime.backends.options import EngineOptions
from runtime.kernel.core import KV_KEEPER, Context
from runtime.kernel.stats import Counters
from runtime.messages import Holder, HolderKind, Release, Reserve

# Reported from the start, so a dashboard sees zeros rather than missing names.
PADDING_COUNTERS = (
    "batch_padding_asks",
    "batch_padding_granted",
    "batch_padding_refused",  # newcomers kept out of the batch (they decode alone)
    "batch_padding_returned",  # partial give-backs after rows left
    "batch_padding_stale",  # replies about an earlier batch's holder
    "batch_join_failed",  # newcomers a step that raised did not take in (they stay alone)
)


@dataclass
class Leaving:
    """A batched sequence that ended (or returns to B=1); its state comes back at the next step."""

    seq: Sequence
    detach: bool  # commit its state to the prefix cache once it is back
    resume: bool = False  # it goes on decoding alone


@dataclass
class BatchStepDone:
    """What a finished batch step leaves for the engine to act on."""

    # Sequences whose state came back out; None: aborted while it waited for this step.
    returned: list[tuple[Sequence, Leaving | None]] = field(default_factory=list)
    stepped: list[tuple[Sequence, StepJob]] = field(default_factory=list)  # members and their token
    failed: list[Sequence] = field(default_factory=list)  # live members of a batch that raised
    orphaned: list[Sequence] = field(default_factory=list)  # ended; their state went with it


@dataclass
class _PaddingAsk:
    """Padding asked of the keeper so that ``seqs`` can join; they hold still until it is used."""

    seqs: tuple[Sequence, ...]
    granted: bool = False

    def newcomers(self) -> list[Sequence]:
        return [s for s in self.seqs if _joinable(s)]


def _joinable(seq: Sequence) -> bool:
    """Decoding alone with a token to feed (shown, or drawn and not read): it may join at the
    next batch step."""
    decoding = seq.decoding
    return (
        seq.phase is Phase.DECODING
        and seq.batch_slot is None
        and decoding is not None
        and (decoding.pending is not None or decoding.ahead is not None)
        and not seq.abort.is_set()
    )


def padding_tokens(offsets: Collection[int]) -> int:
    """Left padding of right-aligned rows (``B * longest - sum``); offsets differ from lengths by
    the same constant for every row, which cancels out."""
    return len(offsets) * max(offsets) - sum(offsets) if offsets else 0


class BatchScheduler:
    """Membership of an engine's decode batch and its padding reservation (see module doc)."""

    def __init__(self, model: str, options: EngineOptions, epoch: int, counters: Counters) -> None:
        self._allowed = options.batching  # the model's option; the backend may forbid it too
        self.enabled = self._allowed
        self.max_batch = options.max_batch
        self._model = model
        self._epoch = epoch
        self._counters = counters
        for name in PADDING_COUNTERS:
            counters.inc(name, 0)
        self.handle: DecodeBatchHandle | None = None
        self._members: dict[int, Sequence] = {}  # slot -> sequence
        self._leaving: dict[int, Leaving] = {}  # sequences whose state is still in the batch
        self._ran_last = False
        self._stepping = False  # a batch step is running: rows may be changing
        # Padding: a row's offset is its KV length minus the batch steps taken before it joined.
        self._bytes_per_token = 0
        self._alloc_step = 1
        self._offsets: dict[int, int] = {}  # member sequence id -> offset
        self._steps = 0
        self._holder_id = 1
        self._opened = False  # the current holder id was used (an ask or a join)
        self._held = 0  # bytes the keeper granted the current holder
        self._ask: _PaddingAsk | None = None
        self._generation = 0  # bumps when the membership changes or a sequence ends
        self._refused: dict[int, int] = {}  # sequence id -> generation its join was refused at
        self._unjoinable: set[int] = (
            set()
        )  # ids of newcomers a failed step left out: alone for good

    def __len__(self) -> int:
        return len(self._members)

    def loaded(self, info: ModelInfo, batchable: bool) -> None:
        """The model is in (or its deferred probe gave its verdict): whether it can batch at
        all, and what one token of padding costs."""
        self.enabled = self._allowed and batchable
        self._bytes_per_token = info.bytes_per_token
        self._alloc_step = info.alloc_step

    @property
    def has_leaving(self) -> bool:
        """Whether some ended sequence's state is still in the batch (its memory not yet free)."""
        return bool(self._leaving)

    @property
    def padding_holder(self) -> Holder:
        """The keeper's name for the current batch's padding bytes."""
        return Holder(
            model=self._model, epoch=self._epoch, kind=HolderKind.BATCH_PADDING, id=self._holder_id
        )

    @property
    def padding_bytes(self) -> int:
        """Bytes the keeper granted the current batch's padding."""
        return self._held

    def holds_back(self, seq: Sequence) -> bool:
        """Whether ``seq`` must not step alone: its padding was asked for, it joins next."""
        return self._ask is not None and seq in self._ask.seqs

    def leave_later(self, seq: Sequence, detach: bool) -> None:
        """``seq`` ended while batched: it leaves at the next step, then the engine releases it."""
        self._leaving[seq.sequence_id] = Leaving(seq, detach)

    def ended(self, seq: Sequence) -> None:
        """A sequence ended: its bytes go back to the keeper, so refused newcomers may try again."""
        self._refused.pop(seq.sequence_id, None)
        self._unjoinable.discard(seq.sequence_id)
        self._generation += 1

    # ------------------------------------------------------------------ planning a step

    def work(self, sequences: Iterable[Sequence], ctx: Context) -> BatchWork | None:
        """What the next batch step would do, or None when nothing calls for batching (or the
        batch holds still while its padding is asked for)."""
        if not self.enabled:
            return None
        sequences = list(sequences)
        leavers = [leaving.seq for leaving in self._leaving.values()]
        members = [s for s in self._members.values() if s.sequence_id not in self._leaving]
        if self._ask is not None:
            newcomers = self._ask.newcomers()
            if newcomers and not self._ask.granted:
                return None
            if newcomers and len(members) + len(newcomers) >= 2:  # paid for: they join now
                return BatchWork(leavers=leavers, joiners=newcomers, members=members)
            if self._ask.granted:  # they are gone: nobody to pay for
                self._ask = None
                self._settle(ctx)
        joinable = [
            s
            for s in sequences
            if _joinable(s)
            and self._refused.get(s.sequence_id) != self._generation
            and s.sequence_id not in self._unjoinable
        ]
        joiners: list[Sequence] = []
        if len(members) + len(joinable) >= 2:
            joiners = joinable[: max(0, self.max_batch - len(members))]
            drawing = sum(1 for s in sequences if s.awaits_first_draw and not s.abort.is_set())
            if drawing and len(members) + len(joinable) + drawing <= self.max_batch:
                # Newcomers whose first draw is next go ahead of the batch anyway (turns.py):
                # once they have drawn, all of them join in one step and one padding ask.
                joiners = []
            wanted = self._padding_need(members, joiners) - self._held
            if joiners and wanted > 0:
                if self._ask is None:
                    self._ask_for_padding(joiners, wanted, ctx)
                    return None
                joiners = []  # an earlier ask is still out; these wait for its answer
        elif len(members) == 1:  # the batch drained to one: it goes back to the fast path
            self._leaving[members[0].sequence_id] = Leaving(members[0], False, resume=True)
            leavers.append(members[0])
            members = []
        if not (leavers or joiners or members):
            return None
        return BatchWork(leavers=leavers, joiners=joiners, members=members)

    def takes_turn(self, work: BatchWork | None, others_ready: bool) -> bool:
        """Whether the batch steps now (the engine then runs ``work`` and reports it to ``done``).
        A newcomer's prefill chunk and a batch step take turns, so neither starves the other."""
        self._ran_last = work is not None and (not others_ready or not self._ran_last)
        self._stepping = self._ran_last
        return self._ran_last

    def _padding_need(self, members: Iterable[Sequence], joiners: Iterable[Sequence]) -> int:
        offsets = [self._offsets[s.sequence_id] for s in members]
        for seq in joiners:
            assert seq.state is not None  # decoding alone, not in compute
            offsets.append(seq.state.length - self._steps)
        # A batch cache grows all its rows a whole allocation step at a time from the padded
        # length, not from a multiple of the step as a row's own cache does, so each row may hold
        # up to alloc_step - 1 spare tokens its own reservation does not price.
        spare = len(offsets) * (self._alloc_step - 1) if len(offsets) >= 2 else 0
        return self._bytes_per_token * (padding_tokens(offsets) + spare)

    def _ask_for_padding(self, joiners: list[Sequence], nbytes: int, ctx: Context) -> None:
        self._opened = True
        self._ask = _PaddingAsk(tuple(joiners))
        self._counters.inc("batch_padding_asks")
        # Only if free now: padding is worth less than anyone's reservation, so it never waits.
        ctx.send(KV_KEEPER, Reserve(holder=self.padding_holder, nbytes=nbytes, timeout_s=0.0))

    # ------------------------------------------------------------------ the keeper's answers

    def reserved(self, holder: Holder, nbytes: int, ctx: Context) -> None:
        """The keeper granted padding bytes: the newcomers join at the next batch step."""
        ask = self._ask
        if holder != self.padding_holder or ask is None or ask.granted:
            # An earlier batch's holder is dead as a whole; the current one keeps what it holds.
            part = None if holder.id != self._holder_id else nbytes
            ctx.send(KV_KEEPER, Release(holder=holder, nbytes=part))
            self._count_stale(ctx)
            return
        ask.granted = True
        self._held += nbytes
        self._counters.inc("batch_padding_granted")
        if not ask.newcomers():
            self._ask = None
            self._settle(ctx)

    def refused(self, holder: Holder, ctx: Context) -> None:
        """No room for the padding: the newcomers decode alone until the membership changes."""
        ask = self._ask
        if holder != self.padding_holder or ask is None or ask.granted:
            if holder.id != self._holder_id:  # what that batch still held is freed with it
                ctx.send(KV_KEEPER, Release(holder=holder))
            self._count_stale(ctx)
            return
        self._ask = None
        for seq in ask.seqs:
            self._refused[seq.sequence_id] = self._generation
        self._counters.inc("batch_padding_refused", len(ask.seqs))
        self._settle(ctx)

    def _count_stale(self, ctx: Context) -> None:
        self._counters.inc("batch_padding_stale")
        ctx.count_dead_letter("stale_padding_reply")

    # ------------------------------------------------------------------ after a step

    def done(self, job: BatchJob, ctx: Context) -> BatchStepDone:
        """Record who left and joined in ``job``; report what the engine must act on."""
        self.handle = job.batch
        self._stepping = False
        self._counters.inc("batch_steps", 1 if job.stepped else 0)
        self._counters.inc("batch_joins", len(job.joined))
        self._counters.inc("batch_leaves", len(job.left))
        self._counters.inc("batched_tokens", len(job.stepped))
        result = BatchStepDone()
        for seq_id, state in job.left.items():
            leaving = self._leaving.pop(seq_id, None)
            seq = leaving.seq if leaving is not None else self._member(seq_id)
            assert seq.batch_slot is not None
            del self._members[seq.batch_slot]
            del self._offsets[seq_id]
            seq.batch_slot, seq.state = None, state
            result.returned.append((seq, leaving))
        joiners = {s.sequence_id: s for s in job.work.joiners}
        for seq_id, slot in job.joined.items():
            seq = joiners[seq_id]
            assert seq.state is not None
            self._offsets[seq_id] = seq.state.length - self._steps
            seq.batch_slot, seq.state = slot, None  # its cache lives in the batch now
            self._members[slot] = seq
            self._opened = True
        self._steps += 1 if job.stepped else 0
        if job.left or job.joined:
            self._generation += 1
        if self._ask is not None and self._ask.granted:
            self._ask = None  # its newcomers joined (or were aborted just before)
        if job.error is not None:
            left_out = [
                s
                for s in job.work.joiners
                if s.sequence_id not in job.joined and not s.abort.is_set()
            ]
            self._unjoinable.update(s.sequence_id for s in left_out)
            self._counters.inc("batch_join_failed", len(left_out))
            self._failed(result)
            self._close(ctx)
            return result
        self._settle(ctx)
        for seq in self._members.values():
            step = job.stepped.get(seq.sequence_id)
            if step is not None:
                result.stepped.append((seq, step))
        return result

    def _member(self, seq_id: int) -> Sequence:
        return next(s for s in self._members.values() if s.sequence_id == seq_id)

    def _failed(self, result: BatchStepDone) -> None:
        """A batch step raised: its cache cannot be trusted, so every member fails and it goes."""
        members, self._members, self.handle = list(self._members.values()), {}, None
        for seq in members:
            seq.batch_slot, seq.state = None, None
            if seq.phase is not Phase.DONE:
                result.failed.append(seq)
        for leaving in self._leaving.values():
            leaving.seq.batch_slot = None
            if not leaving.resume:  # one going back to B=1 is live: it fails with the members
                result.orphaned.append(leaving.seq)
        self._leaving.clear()

    # ------------------------------------------------------------------ giving padding back

    def _settle(self, ctx: Context) -> None:
        """Give back the padding the rows no longer need; close the batch once it has none."""
        if self._stepping or self._ask is not None:
            return  # rows may change, or bytes are gathered for newcomers: settled after that
        if not self._members:
            self._close(ctx)
            return
        need = self._padding_need(self._members.values(), ())
        if self._held > need:
            # Down to nothing: released whole, so the keeper does not keep listing the holder.
            part = self._held - need if need else None
            self._held = need
            self._counters.inc("batch_padding_returned")
            ctx.send(KV_KEEPER, Release(holder=self.padding_holder, nbytes=part))

    def _close(self, ctx: Context) -> None:
        """No rows left: hand the padding back and retire the holder id, so the next batch gets
        a fresh one and a late reply about this one is recognised as stale."""
        if not self._opened:
            return
        if self._held:
            # A grant still in flight is not ours to free here: its (stale) reply releases it.
            part = self._held if self._ask is not None else None
            ctx.send(KV_KEEPER, Release(holder=self.padding_holder, nbytes=part))
        self._held, self._ask, self._opened = 0, None, False
        self._offsets.clear()
        self._holder_id += 1
