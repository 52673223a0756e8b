"""A new sequence's way from ``Admit`` to its first compute job.

1. ``admit``: the sequence is made from the request. It waits for its prompt's tokens: a tokenize
   job (``tokenized``), unless the request gave them and the model is loaded.
2. Once tokenized: an empty prompt, or one that leaves no room for a reply, fails; a
   ``max_tokens`` past the room left is lowered to it (``Usage.max_tokens_clamped_to``), or with
   ``strict_max_tokens`` fails, as a prompt that with it overflows the context does;
   the session's instructions prefix is planned for pinning; a prewarm with nothing to prefill is
   done at once; the sequence supersedes its session's older work, adopts the prewarm it extends,
   or (a prewarm) follows an identical one and waits for it to end (``plan_supersede``,
   supersede.py, a plan the admission then carries out). A follower whose leader is cancelled or
   fails is let go (``let_go``): it goes on by itself.
3. The admission gate: at most ``max_concurrent`` sequences are past it (followers are not); the
   others wait FIFO.
4. ``Reserve`` its KV (prompt plus ``max_tokens``, and room for the checkpoint snapshots of its
   prefill when the cache cannot be trimmed), then ``Lookup`` the prefix cache; the sequence
   then restores (``RESTORING``) and the engine core's pump takes it from there. The ``Lookup``
   rides on the ``Reserve`` (``then_lookup``): the keeper sends it on once it grants, so the
   lookup never waits for a grant to reach the engine and come back (two of the six crossings
   before a Ray engine's first token; the ``lookup_with_reserve`` option turns it off, to
   measure). A generate that adopted a prewarm skips the lookup: once reserved it resumes where
   the prewarm was. A generate sent with ``reuse_prefix=False`` skips it too and restores
   nothing (a cold prefill).

Admission ends sequences through ``SequenceEnds`` (the engine's ``Endings``, endings.py).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Protocol, assert_never

from actors.engine.checkpoints import CheckpointPolicy
from actors.engine.disk_tier import DiskTier
from actors.engine.draft_model import DraftModel
from actors.engine.entries import EntryStore
from actors.engine.jobs import TokenizeJob
from actors.engine.sequence import Phase, Sequence
from actors.engine.supersede import Adopt, Join, Supersede, identical_leader, plan_supersede
from actors.replicas import replica_base
from runtime.backends.contract import ModelInfo
from runtime.backends.vision.media import is_media
from runtime.errors import ContextLengthExceeded, InvalidRequest, MlxRuntimeError
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, Context
from runtime.kernel.stats import Counters
from runtime.messages import (
    Admit,
    FinishReason,
    Holder,
    HolderKind,
    Lookup,
    LookupResult,
    Release,
    ReleaseLease,
    RequestKind,
    Reserve,
    ReusePath,
)

log = logging.getLogger("mlx_actor_runtime.engine")


class SequenceEnds(Protocol):
    """What admission asks of the engine's ``Endings``: to end a sequence."""

    def finish(self, seq: Sequence, ctx: Context, reason: FinishReason) -> None: ...

    def fail(self, seq: Sequence, ctx: Context, error: MlxRuntimeError) -> None: ...

    def abort(self, seq: Sequence, reason: str, ctx: Context) -> None: ...


@dataclass(frozen=True)
class AdmissionLimits:
    max_concurrent: int  # sequences past the admission gate at once
    reservation_timeout_s: float  # how long a sequence's Reserve may queue at the keeper
    default_max_tokens: int  # cap for a generate that set no max_tokens ("the rest of the context")
    chunk_tokens: int  # prefill chunk size: a windowed cache holds a chunk beyond its window
    checkpoints: CheckpointPolicy  # where prefills of an untrimmable cache snapshot, and how much
    strict_max_tokens: bool = False  # False: a max_tokens past the room left is lowered to it
    speculative: int = 0  # most drafts per pass for a generate that does not say (0: none)
    lookup_with_reserve: bool = True  # a sequence's Lookup rides on its Reserve


# --------------------------------------------------------------------------- admission


class Admission:
    """The admission steps of one engine (see module docstring).

    ``sequences`` is the engine's own table of live sequences, shared: admission adds to it and
    reads it; ``Endings`` removes what ends.
    """

    def __init__(
        self,
        limits: AdmissionLimits,
        model: str,
        sequences: dict[int, Sequence],
        entries: EntryStore,
        counters: Counters,
        *,
        ends: SequenceEnds,
        disk: DiskTier,
    ) -> None:
        self._disk = disk
        self._limits = limits
        self._model = model
        self._sequences = sequences
        self._entries = entries
        self._counters = counters
        self._ends = ends
        self._info: ModelInfo | None = None
        self.draft: DraftModel | None = None  # the model's draft model, from its load on
        self._waiting: deque[Sequence] = deque()  # at the gate, FIFO

    def admit(self, admit: Admit, ctx: Context) -> None:
        """A new sequence for ``admit`` (of this engine's epoch, which is not draining)."""
        seq = Sequence.admitted(admit, self._model)
        if seq.kind is RequestKind.GENERATE:
            asked = seq.sampling.speculative
            seq.drafts = self._limits.speculative if asked is None else asked
        self._sequences[seq.sequence_id] = seq
        self._counters.inc(f"admitted_{seq.kind}")
        if admit.tokens is not None:
            self._counters.inc("admitted_tokenized")  # moved here: tokenized by its first replica
        if seq.tokens is not None and self._info is not None:
            self._tokenized(seq, ctx)

    def loaded(self, info: ModelInfo, ctx: Context, draft: DraftModel | None = None) -> None:
        """The model is in (with its draft model, if any): sequences that came with their tokens
        go on."""
        self._info = info
        self.draft = draft
        for seq in list(self._sequences.values()):
            if seq.tokens is not None and seq.phase is Phase.TOKENIZING:
                self._tokenized(seq, ctx)

    def probed(self, info: ModelInfo) -> None:
        """The deferred load probe's verdict: sequences admitted from now on plan by ``info``."""
        self._info = info

    def tokenized(self, job: TokenizeJob, ctx: Context) -> None:
        """A tokenize job came back; each of its sequences still waiting for tokens goes on."""
        # Only the sequences this job tokenized: others admitted meanwhile wait for the next one.
        for seq_id in [*job.results, *job.failures]:
            seq = self._sequences.get(seq_id)
            if seq is None or seq.phase is not Phase.TOKENIZING or seq.tokens is not None:
                continue
            failure = job.failures.get(seq.sequence_id)
            tokens = job.results.get(seq.sequence_id)
            if isinstance(failure, MlxRuntimeError):  # bad chat input, context overflow
                self._ends.fail(seq, ctx, failure)
            elif tokens is None:
                error = InvalidRequest(f"the prompt could not be tokenized: {failure!r}")
                self._ends.fail(seq, ctx, error)
            else:
                prepared = job.prepared.get(seq.sequence_id)
                if prepared is not None:
                    seq.instructions_tokens = prepared.instructions_tokens
                    seq.message_ends = prepared.message_ends
                    seq.dropped_turns = prepared.dropped_turns
                    seq.reasoning_open = prepared.reasoning_open
                seq.tokens = tuple(tokens)
                self._tokenized(seq, ctx)

    def _tokenized(self, seq: Sequence, ctx: Context) -> None:
        assert seq.tokens is not None
        assert self._info is not None
        info = self._info
        if not seq.tokens:
            error = InvalidRequest(
                "the prompt is empty after tokenization; send at least one token"
            )
            self._ends.fail(seq, ctx, error)
            return
        # An embedding lookup past its table is garbage; the ids of images' soft tokens lie
        # above every vocabulary and come only from the model's own tokenizing (vision/media.py).
        given = seq.request.prompt_tokens is not None
        outside = (
            sorted({t for t in seq.tokens if t >= info.vocab_size and (given or not is_media(t))})
            if max(seq.tokens) >= info.vocab_size
            else []
        )
        if outside:
            error = InvalidRequest(
                f"prompt_tokens names token ids outside the model's vocabulary of "
                f"{info.vocab_size} (ids 0 to {info.vocab_size - 1}): {outside[:5]}; remove them"
            )
            self._ends.fail(seq, ctx, error)
            return
        room = info.context_length - len(seq.tokens)
        if seq.kind is RequestKind.GENERATE and room < 1:
            error = ContextLengthExceeded(
                f"the prompt is {len(seq.tokens)} tokens: it fills the model's context of "
                f"{info.context_length} tokens and leaves no room for a reply; shorten the prompt"
            )
            self._ends.fail(seq, ctx, error)
            return
        generate = seq.kind is RequestKind.GENERATE
        if generate and seq.max_tokens == 0:  # "the rest of the context"
            seq.max_tokens = min(room, self._limits.default_max_tokens)
        elif generate and seq.max_tokens > room and not self._limits.strict_max_tokens:
            seq.max_tokens_clamped = True  # lowered to the room left, as llama-server and mlx-lm do
            seq.max_tokens = room
        wanted = _tokens_to_reserve(seq)
        if wanted > info.context_length:
            error = ContextLengthExceeded(
                f"prompt ({len(seq.tokens)} tokens) plus max_tokens ({seq.max_tokens}) exceeds "
                f"the model's context of {info.context_length} tokens; shorten the prompt or "
                "lower max_tokens"
            )
            self._ends.fail(seq, ctx, error)
            return
        # ignore_eos keeps a constraint's EOS: once its grammar is complete only EOS may follow.
        if not seq.request.ignore_eos or seq.sampling.constraint is not None:
            seq.stop_token_ids = seq.stop_token_ids | info.eos_token_ids
        self._entries.plan_pin(seq, ctx)
        if seq.kind is RequestKind.PREWARM and seq.prefill_target == 0:
            self._ends.finish(seq, ctx, FinishReason.PREWARMED)
            return
        self._supersede(seq, ctx)
        if seq.leader is None:
            self._gate(seq, ctx)

    def _gate(self, seq: Sequence, ctx: Context) -> None:
        """Through the admission gate to its KV reservation, or wait FIFO for a slot."""
        if self._running() >= self._limits.max_concurrent:
            seq.phase = Phase.WAITING
            self._waiting.append(seq)
            self._counters.inc("admission_waits")
            return
        self._reserve(seq, ctx)

    # ------------------------------------------------------------------ supersede / adopt

    def _supersede(self, seq: Sequence, ctx: Context) -> None:
        """Carry out ``plan_supersede``: follow, adopt, supersede (supersede.py)."""
        for step in plan_supersede(seq, list(self._sequences.values())).steps:
            match step:
                case Join(leader=leader):
                    self._follow(seq, leader)
                case Adopt(prewarm=prewarm):
                    self._adopt(seq, prewarm, ctx)
                case Supersede(older=older):
                    if older.phase is Phase.DONE:  # ended meanwhile, by an earlier step's ending
                        continue
                    self._ends.abort(older, "superseded", ctx)
                    generate = older.kind is RequestKind.GENERATE
                    self._counters.inc(
                        "generates_superseded" if generate else "prewarms_superseded"
                    )
                case _:
                    assert_never(step)

    def _adopt(self, seq: Sequence, prewarm: Sequence, ctx: Context) -> None:
        seq.state, prewarm.state = prewarm.state, None
        seq.lease_id, prewarm.lease_id = prewarm.lease_id, None
        seq.checkpoints, prewarm.checkpoints = prewarm.checkpoints, []
        seq.snapshots, prewarm.snapshots = prewarm.snapshots, []
        seq.generation = prewarm.generation
        seq.restore_entry, seq.restore_length = prewarm.restore_entry, prewarm.restore_length
        seq.in_compute, prewarm.in_compute = prewarm.in_compute, False
        seq.resume_phase = prewarm.phase
        seq.path = ReusePath.ADOPTED
        prewarm.adopted_by = seq
        self._counters.inc("prewarms_adopted")
        self._ends.finish(prewarm, ctx, FinishReason.ADOPTED)

    def _follow(self, seq: Sequence, leader: Sequence) -> None:
        seq.leader = leader
        seq.phase = Phase.FOLLOWING
        self._counters.inc("prewarms_deduplicated")

    def let_go(self, followers: list[Sequence], ctx: Context) -> None:
        """Their leader ended without a finish they share (it was cancelled or failed): each goes
        on by itself, or follows the first of them that does."""
        for seq in followers:
            seq.leader = None
            leader = identical_leader(seq, self._sequences.values())
            if leader is not None:
                seq.leader = leader
            else:
                self._counters.inc("followers_let_go")
                self._gate(seq, ctx)

    # ------------------------------------------------------------------ the gate and the KV

    def _running(self) -> int:
        """Sequences past the admission gate (reserving, looking up, computing)."""
        waiting = (Phase.TOKENIZING, Phase.WAITING, Phase.FOLLOWING)
        return sum(1 for s in self._sequences.values() if s.phase not in waiting)

    def admit_waiting(self, ctx: Context) -> None:
        """Let sequences through the gate while it has room (after a sequence ended)."""
        while self._waiting and self._running() < self._limits.max_concurrent:
            seq = self._waiting.popleft()
            if seq.phase is Phase.WAITING:  # not cancelled while it waited
                self._reserve(seq, ctx)

    def _reserve(self, seq: Sequence, ctx: Context) -> None:
        """Ask for the sequence's KV, with room for the snapshots its prefill may take."""
        assert self._info is not None
        seq.phase = Phase.RESERVING
        if not self._info.verifies:  # a backend with no verification pass cannot speculate
            seq.drafts = 0
        kv = self._info.kv_bytes(_tokens_to_reserve(seq), self._limits.chunk_tokens)
        if seq.drafts:
            # Drafts stay within max_tokens; a verification pass keeps the untrimmable layers
            # as they were before it (a window per sliding layer, the recurrent state) meanwhile.
            kv += self._info.snapshot_bytes
            if self.draft is not None:  # and the draft model's state follows the sequence
                kv += self.draft.kv_bytes(_tokens_to_reserve(seq))
        # The lookup follows the grant at the keeper, not a round trip later (module docstring).
        seq.lookup_sent_on = (
            self._limits.lookup_with_reserve and seq.resume_phase is None and seq.reuse_prefix
        )
        ctx.send(
            KV_KEEPER,
            Reserve(
                holder=seq.holder,
                nbytes=kv + self._plan_snapshots(seq, kv),
                timeout_s=self._limits.reservation_timeout_s,
                then_lookup=self._lookup(seq) if seq.lookup_sent_on else None,
            ),
        )

    def _plan_snapshots(self, seq: Sequence, kv: int) -> int:
        """Set the sequence's checkpoint rule; the bytes its snapshots need (adopted ones too)."""
        assert self._info is not None
        policy = self._limits.checkpoints
        held = sum(taken.nbytes for taken in seq.snapshots)  # taken by a prewarm it adopted
        if kv + held > policy.budget_bytes:
            seq.snapshots.clear()  # the request must fit the budget; its snapshots need not
            held = 0
        free = policy.budget_bytes - kv - held
        seq.checkpoint_rule = policy.rule(
            self._info, seq.prefill_target, len(seq.message_ends), free
        )
        most = 0 if seq.checkpoint_rule is None else seq.checkpoint_rule.most
        seq.snapshot_room = most * self._info.snapshot_bytes
        return held + seq.snapshot_room

    def reserved(self, holder: Holder, ctx: Context) -> Sequence | None:
        """The keeper granted a sequence's KV: look up the prefix cache, or resume an adoption.

        Returns the adopting generate whose prefill goes on now (the prewarm's step came back
        while it waited for its KV), for the core to advance; else None.
        """
        seq = self._sequences.get(holder.id)
        if (
            holder.kind is not HolderKind.SEQUENCE
            or seq is None
            or seq.phase is not Phase.RESERVING
        ):
            ctx.send(KV_KEEPER, Release(holder=holder))  # its sequence ended while it waited
            ctx.count_dead_letter("stale_reservation_reply")
            return None
        seq.reserved = True
        if seq.resume_phase is not None:
            seq.phase = seq.resume_phase
            advanced = seq.phase is Phase.PREFILLING and not seq.in_compute
            return seq if advanced else None
        if not seq.reuse_prefix:  # told to prefill everything: a miss without asking
            self._counters.inc("lookups_skipped")
            seq.restore_entry, seq.restore_length = None, 0
            seq.cached_tokens, seq.path = 0, ReusePath.MISS
            seq.phase = Phase.RESTORING
            return None
        seq.phase = Phase.LOOKING_UP
        if not seq.lookup_sent_on:  # else the keeper sent it on after Reserved: it answers next
            ctx.send(PREFIX_CACHE, self._lookup(seq))
        return None

    def _lookup(self, seq: Sequence) -> Lookup:
        assert seq.tokens is not None
        # A replica's request may move to another replica: its prompt's rendering goes with it.
        replica = replica_base(self._model) is not None
        return Lookup(
            model=self._model,
            epoch=seq.epoch,
            namespace=seq.namespace,
            tokens=seq.tokens,
            sequence_id=seq.sequence_id,
            facts=seq.facts() if replica else None,
        )

    def looked_up(self, result: LookupResult, ctx: Context) -> None:
        """The prefix cache answered: restore from its hit (leased), or from nothing."""
        seq = self._sequences.get(result.sequence_id)
        if seq is None or result.epoch != seq.epoch or seq.phase is not Phase.LOOKING_UP:
            if result.lease_id is not None:
                ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=result.lease_id))
            ctx.count_dead_letter("stale_lookup_result")
            return
        seq.lease_id, seq.generation = result.lease_id, result.generation
        entry_id, matched, path = result.entry_id, result.matched, result.path
        if entry_id is not None and entry_id not in self._entries:
            self._counters.inc("fallback_entry_missing")
            entry_id, matched, path = None, 0, ReusePath.MISS
            if seq.lease_id is not None:  # nothing of it is used: let it be evicted
                ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
                seq.lease_id = None
        if seq.kind is RequestKind.PREWARM and matched >= seq.prefill_target:
            self._counters.inc("prewarms_already_warm")
            self._ends.finish(seq, ctx, FinishReason.PREWARMED)
            return
        seq.restore_entry, seq.restore_length = entry_id, matched
        seq.cached_tokens, seq.path = matched, path
        seq.phase = Phase.RESTORING
        if (on_disk := self._disk.better(seq, matched)) is not None:
            seq.phase = Phase.LOADING  # the RAM hit stays leased in case the file fails
            self._disk.load(seq, on_disk, ctx)

    def restore_fell_back(self, seq: Sequence, reason: str, ctx: Context) -> None:
        """The restore could not use the lookup's hit (``reason``): the prompt is prefilled cold."""
        self._counters.inc(f"fallback_{reason}")  # before Started: nothing was counted as reused
        log.debug("sequence %d: reuse fell back to a cold prefill (%s)", seq.sequence_id, reason)
        seq.cached_tokens, seq.path = 0, ReusePath.MISS
        if seq.lease_id is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
            seq.lease_id = None


def _tokens_to_reserve(seq: Sequence) -> int:
    """A generate's prompt and its replies' room; a prewarm's prompt."""
    assert seq.tokens is not None
    return len(seq.tokens) + (seq.max_tokens if seq.kind is RequestKind.GENERATE else 0)
