"""A new sequence's way from ``Admit`` to its first compute job.

``admit`` makes the sequence; once its prompt is tokenized (a tokenize job, unless the request
gave the tokens) it is checked against the context (``max_tokens`` clamped, or failed with
``strict_max_tokens``), its instructions prefix planned for pinning, and ``plan_supersede``
(supersede.py) carried out: it supersedes its session's older work, adopts the prewarm it extends,
or (a prewarm) follows an identical one. Then the gate (gate.py) and its KV reservation; once
granted (``reserved``) and the prefix cache answered (``looked_up``) it restores, and the compute
slot takes it from there. The phases and their moves: docs/design.md, "A sequence's lifecycle".
"""

from __future__ import annotations

import logging
from typing import Protocol, assert_never

from actors.engine.compute import hand_over
from actors.engine.disk_tier import DiskTier
from actors.engine.entries import EntryStore
from actors.engine.gate import AdmissionLimits as AdmissionLimits
from actors.engine.gate import Gate, tokens_to_reserve
from actors.engine.jobs import TokenizeJob
from actors.engine.sequence import Phase, Sequence
from actors.engine.supersede import Adopt, Join, Supersede, plan_supersede
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
    LookupResult,
    Release,
    ReleaseLease,
    RequestKind,
    ReusePath,
    common_prefix_length,
)

log = logging.getLogger("mlx_actor_runtime.engine")


class SequenceEnds(Protocol):
    """What admission asks of the engine's ``Endings``: to end a sequence."""

    def finish(self, seq: Sequence, ctx: Context, reason: FinishReason) -> None: ...

    def fail(self, seq: Sequence, ctx: Context, error: MlxRuntimeError) -> None: ...

    def abort(self, seq: Sequence, reason: str, ctx: Context) -> None: ...


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
        gate: Gate,
        disk: DiskTier,
    ) -> None:
        self._gate = gate
        self._disk = disk
        self._limits = limits
        self._model = model
        self._sequences = sequences
        self._entries = entries
        self._counters = counters
        self._ends = ends
        self._info: ModelInfo | None = None

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

    def loaded(self, info: ModelInfo, ctx: Context) -> None:
        """The model is in (the gate knows it first): sequences that came with their tokens go
        on."""
        self._info = info
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
        wanted = tokens_to_reserve(seq)
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
            self._gate.enter(seq, ctx)

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

    def _reach(self, seq: Sequence, entry_id: int | None, path: ReusePath) -> int:
        """On a checkpoint hit, how much of the entry the prompt shares (leaving its last token
        to compute, as the prefix cache does): more than the checkpoint when the prompt branches
        past it. The restore cuts back there where the backend still can (``reach``)."""
        if path is not ReusePath.CHECKPOINT or entry_id is None or seq.tokens is None:
            return 0
        entry = self._entries.tokens(entry_id)
        return common_prefix_length(entry, seq.tokens, limit=len(seq.tokens) - 1)

    def _adopt(self, seq: Sequence, prewarm: Sequence, ctx: Context) -> None:
        seq.state, prewarm.state = prewarm.state, None
        seq.lease_id, prewarm.lease_id = prewarm.lease_id, None
        seq.checkpoints, prewarm.checkpoints = prewarm.checkpoints, []
        seq.snapshots, prewarm.snapshots = prewarm.snapshots, []
        seq.generation = prewarm.generation
        seq.restore_entry, seq.restore_length = prewarm.restore_entry, prewarm.restore_length
        seq.reach_length = prewarm.reach_length
        hand_over(prewarm, seq)
        seq.resume_phase = prewarm.phase
        seq.path = ReusePath.ADOPTED
        prewarm.adopted_by = seq
        self._counters.inc("prewarms_adopted")
        self._ends.finish(prewarm, ctx, FinishReason.ADOPTED)

    def _follow(self, seq: Sequence, leader: Sequence) -> None:
        seq.leader = leader
        seq.move(Phase.FOLLOWING)
        self._counters.inc("prewarms_deduplicated")

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
        if (resumed := seq.resume_phase) is not None:
            seq.move(resumed)
            advanced = resumed is Phase.PREFILLING and not seq.in_compute
            return seq if advanced else None
        if not seq.reuse_prefix:  # told to prefill everything: a miss without asking
            self._counters.inc("lookups_skipped")
            seq.restore_entry, seq.restore_length = None, 0
            seq.cached_tokens, seq.path = 0, ReusePath.MISS
            seq.move(Phase.RESTORING)
            return None
        seq.move(Phase.LOOKING_UP)
        if not seq.lookup_sent_on:  # else the keeper sent it on after Reserved: it answers next
            ctx.send(PREFIX_CACHE, self._gate.lookup(seq))
        return None

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
        seq.takeable = result.takeable and entry_id is not None
        if seq.kind is RequestKind.PREWARM and matched >= seq.prefill_target:
            self._counters.inc("prewarms_already_warm")
            self._ends.finish(seq, ctx, FinishReason.PREWARMED)
            return
        seq.restore_entry, seq.restore_length = entry_id, matched
        seq.reach_length = self._reach(seq, entry_id, path)
        seq.cached_tokens, seq.path = matched, path
        if (on_disk := self._disk.better(seq, matched)) is None:
            seq.move(Phase.RESTORING)
        else:
            seq.move(Phase.LOADING)  # the RAM hit stays leased in case the file fails
            self._disk.load(seq, on_disk, ctx)
