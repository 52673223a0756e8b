"""The admission gate of one engine, and the KV reservation a sequence asks for past it.

At most ``max_concurrent`` sequences are past the gate (followers are not); the others wait FIFO
and go through as endings free room (``admit_waiting``, run by ``Endings`` after each ending).
Past the gate a sequence ``Reserve``s its KV (prompt plus ``max_tokens``, and room for the
checkpoint snapshots of its prefill when the cache cannot be trimmed), with its ``Lookup`` riding
on the ``Reserve`` (``then_lookup``) unless ``lookup_with_reserve`` is off. The gate ends no
sequence, so ``Endings`` can own it without a cycle back into admission. See docs/design.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from actors.engine.checkpoints import CheckpointPolicy
from actors.engine.draft_model import DraftModel
from actors.engine.sequence import Phase, Sequence
from actors.engine.supersede import identical_leader
from actors.replicas import replica_base
from runtime.backends.contract import ModelInfo
from runtime.backends.vision.media import longest_run
from runtime.kernel.core import KV_KEEPER, Context
from runtime.kernel.stats import Counters
from runtime.messages import Lookup, RequestKind, Reserve


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


class Gate:
    """The gate and the KV asks of one engine (see module docstring); reads its ``sequences``."""

    def __init__(
        self,
        limits: AdmissionLimits,
        model: str,
        sequences: dict[int, Sequence],
        counters: Counters,
    ) -> None:
        self._limits = limits
        self._model = model
        self._sequences = sequences
        self._counters = counters
        self._info: ModelInfo | None = None
        self._draft: DraftModel | None = None
        self._waiting: deque[Sequence] = deque()  # at the gate, FIFO

    def loaded(self, info: ModelInfo, draft: DraftModel | None = None) -> None:
        """The model is in (or its deferred probe gave its verdict): reservations price by it."""
        self._info = info
        self._draft = draft

    def enter(self, seq: Sequence, ctx: Context) -> None:
        """Through the admission gate to its KV reservation, or wait FIFO for a slot."""
        if self._running() >= self._limits.max_concurrent:
            seq.move(Phase.WAITING)
            self._waiting.append(seq)
            self._counters.inc("admission_waits")
            return
        self._reserve(seq, ctx)

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
                self.enter(seq, ctx)

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
        seq.move(Phase.RESERVING)
        if not self._info.verifies:  # a backend with no verification pass cannot speculate
            seq.drafts = 0
        # A chunk ends after an image's run of soft tokens rather than inside it (jobs.py), so it
        # may hold one run more than the chunk size: a sliding ring holds that chunk.
        chunk = self._limits.chunk_tokens + longest_run(seq.tokens or ())
        kv = self._info.kv_bytes(tokens_to_reserve(seq), chunk)
        if seq.drafts:
            # Drafts stay within max_tokens; a verification pass keeps the untrimmable layers
            # as they were before it (a window per sliding layer, the recurrent state) meanwhile.
            kv += self._info.snapshot_bytes
            if self._draft is not None:  # and the draft model's state follows the sequence
                kv += self._draft.kv_bytes(tokens_to_reserve(seq))
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
                then_lookup=self.lookup(seq) if seq.lookup_sent_on else None,
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
        # A generate's tokens at most; a prewarm's state may yet be adopted by a longer one.
        longest = tokens_to_reserve(seq) if seq.kind is RequestKind.GENERATE else None
        seq.checkpoint_rule = policy.rule(
            self._info, seq.prefill_target, len(seq.message_ends), free, longest=longest
        )
        most = 0 if seq.checkpoint_rule is None else seq.checkpoint_rule.most
        seq.snapshot_room = most * self._info.snapshot_bytes
        return held + seq.snapshot_room

    def lookup(self, seq: Sequence) -> Lookup:
        """The sequence's prefix-cache lookup."""
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
            # A prewarm finds its prompt already cached and ends: it keeps the entry.
            take_within=take_within(self._info) if seq.kind is RequestKind.GENERATE else -1,
        )


def take_within(info: ModelInfo | None) -> int:
    """The most tokens of an entry past the reuse point a lookup may give up to take the entry
    instead of copying it (``Lookup.take_within``): the model's ``take_tail_tokens``, or -1
    (never) where that is 0. One policy for every backend; only the figure is the model's
    (docs/reuse.md, "Taking an entry instead of copying it")."""
    return info.take_tail_tokens if info is not None and info.take_tail_tokens > 0 else -1


# Sequences whose lookup may yet name any entry: not sent yet (a burst's later requests, still
# tokenized or queued at the gate, would find a taken entry gone and run cold), on its way, or
# sent on by the keeper (``Reserve.then_lookup``) before the manager hears of a take.
_AWAITING_LOOKUP = frozenset(
    {Phase.TOKENIZING, Phase.WAITING, Phase.FOLLOWING, Phase.RESERVING, Phase.LOOKING_UP}
)


def may_take(seq: Sequence, sequences: Iterable[Sequence]) -> bool:
    """Whether ``seq``'s restore may take its leased entry (the prefix cache marked it
    ``takeable``) instead of copying it: no other sequence of this engine holds it (a lease on
    it: its restore may not have run, or a prewarm adopted later would need it) or awaits a
    lookup that could name it. Only this engine's sequences lease its entries, so this sees
    every other claim; a burst of requests on one entry copies it, each finding the others
    (docs/reuse.md, "Taking an entry instead of copying it")."""
    if not seq.takeable:
        return False
    return not any(
        other is not seq
        and (
            other.phase in _AWAITING_LOOKUP
            or (other.lease_id is not None and other.restore_entry == seq.restore_entry)
        )
        for other in sequences
    )


def tokens_to_reserve(seq: Sequence) -> int:
    """A generate's prompt and its replies' room; a prewarm's prompt."""
    assert seq.tokens is not None
    return len(seq.tokens) + (seq.max_tokens if seq.kind is RequestKind.GENERATE else 0)
