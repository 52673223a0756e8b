"""What the engine's compute slot runs next: one plan value per step, decided in one place.

As vLLM v1's scheduler returns one ``SchedulerOutput`` per step, ``StepPlanner.next`` returns one
``Plan``; the compute slot (compute.py) only carries it out and stepping.py applies what it leaves.
The order: tokenizing first; then a step of the decode batch and single steps take turns, single
steps round-robin by sequence id; a newcomer about to finish its prompt may go ahead (turns.py), and
fresh prompts' rests may be prefilled together. ``behind`` says whether a lone stream's next step
may queue behind the running one.

See docs/design.md, "One step".
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.batch import BatchScheduler
from actors.engine.chunking import ChunkSizer
from actors.engine.jobs import BatchWork
from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from actors.engine.turns import PromptTurns, rows_taken
from runtime.backends.contract import Capability, ModelInfo
from runtime.kernel.core import Context
from runtime.messages import RequestKind


@dataclass(frozen=True)
class Tokenize:
    """Tokenize every prompt waiting for its tokens, in one job."""

    seqs: list[Sequence]


@dataclass(frozen=True)
class BatchStep:
    """One step of the decode batch: its leavers leave, its joiners join, its members step."""

    work: BatchWork


@dataclass(frozen=True)
class Decode:
    """A decode step of one sequence outside the batch; ``ahead``: a newcomer's first draw that
    goes ahead of the decode work (it leaves that work waiting and queues nothing behind it)."""

    seq: Sequence
    ahead: bool = False


@dataclass(frozen=True)
class Prefill:
    """A restore or a prefill chunk of ``seqs[0]`` (``chunk`` tokens); with several sequences,
    the whole rests of their prompts in one batched pass."""

    seqs: tuple[Sequence, ...]
    chunk: int = 0


Plan = Tokenize | BatchStep | Decode | Prefill


class StepPlanner:
    """Decides each step's ``Plan`` for one engine (see module docstring)."""

    def __init__(
        self,
        sizer: ChunkSizer,
        sequences: dict[int, Sequence],
        batches: BatchScheduler,
        turns: PromptTurns,
    ) -> None:
        self._sizer = sizer
        self._sequences = sequences
        self._batches = batches
        self._turns = turns
        self._last_served = 0  # sequence id of the last single step: the round-robin's place

    def next(self, info: ModelInfo, ctx: Context) -> Plan | None:
        """The next step's plan, or None when no sequence has compute work."""
        waiting = [s for s in self._sequences.values() if s.phase is Phase.TOKENIZING]
        if waiting:
            return Tokenize(waiting)
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
                return self._single(newcomer, info, ready, ahead=True)
            owed = self._turns.decode_owed(now)
            if owed:  # decoding waited its limit behind newcomers: it goes first
                ready.sort(key=lambda s: s.phase is not Phase.DECODING)
        else:
            self._turns.decode_ran()
        batch_now = self._batches.takes_turn(work, bool(ready) and not owed)  # work or not
        if work is not None and batch_now:
            self._turns.decode_ran()
            return BatchStep(work)
        if ready:
            return self._single(ready[0], info, ready, lone=not decoders_wait)
        return None

    def behind(self, running: Sequence) -> Decode | None:
        """A lone stream's next decode step, to queue behind its running one (compute.py's
        ``top_up``); None while anything else could use the slot."""
        if running.phase is not Phase.DECODING or not self._alone(running):
            return None
        return Decode(running)

    def first_draw_behind(self, prefilling: Sequence) -> bool:
        """Whether a lone generate's first draw may queue behind the running chunk that ends its
        prompt (compute.py's ``top_up``): not one with checkpoints or its instructions to pin
        (the loop files those snapshots first), drafts to verify or a grammar to hold (their
        state is set up or released with the sequence's decoding); never while anything else
        could use the slot."""
        return (
            prefilling.kind is RequestKind.GENERATE
            and prefilling.phase is Phase.PREFILLING
            and not prefilling.checkpoints
            and not prefilling.drafts
            and prefilling.sampling.constraint is None
            and self._alone(prefilling)
        )

    def _alone(self, running: Sequence) -> bool:
        """Nothing but ``running``'s steps could use the slot: no batch, no other sequence with
        work, and its abort flag is clear."""
        return not (
            running.batch_slot is not None
            or running.abort.is_set()
            or len(self._batches)
            or self._batches.has_leaving
            or any(s is not running and s.phase in SCHEDULED for s in self._sequences.values())
        )

    def _single(
        self,
        seq: Sequence,
        info: ModelInfo,
        ready: list[Sequence],
        *,
        ahead: bool = False,
        lone: bool = False,
    ) -> Plan:
        """A step of ``seq``: a decode step, a restore or a prefill chunk; or the fresh prompts'
        rests of several, ``seq``'s among them, together."""
        self._last_served = seq.sequence_id
        if seq.phase is Phase.DECODING:
            if not ahead:
                self._turns.decode_ran()
            return Decode(seq, ahead)
        chunk = self._sizer.tokens(lone) if seq.phase is Phase.PREFILLING else 0
        if not info.capable(Capability.BATCH_PREFILL):  # the load probe may forbid it
            return Prefill((seq,), chunk)
        return Prefill(self._together(seq, ready, chunk, info.together_snapshot_tokens), chunk)

    def _together(
        self, seq: Sequence, ready: list[Sequence], chunk: int, snapshot_reach: int
    ) -> tuple[Sequence, ...]:
        """``seq`` and the ready sequences whose prompts may be prefilled with it in one batched
        pass: each the whole rest of its prompt within one chunk, as many as the decode batch has
        rows free for, at most ``TOGETHER_CHUNKS`` chunks' tokens in all (a member's abort waits
        for the whole pass). A prompt with checkpoints to take (or its session's instructions to
        pin) joins only where the pass can snapshot inside it (``snapshot_reach`` tokens)."""
        if not self._batches.enabled or not _rest_in_one_pass(seq, chunk, snapshot_reach):
            return (seq,)
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
        return tuple(group)


# Phases with work for the compute slot: any sequence in them keeps a stream from queueing ahead.
SCHEDULED = COMPUTE_PHASES | {Phase.TOKENIZING}

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
