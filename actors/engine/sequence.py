"""One sequence's state inside an engine: the request it serves, its phase and its cache."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from actors.engine.checkpoints import CheckpointRule
from actors.engine.lifecycle import COMPUTE_PHASES as COMPUTE_PHASES
from actors.engine.lifecycle import Phase as Phase
from actors.engine.lifecycle import check_move
from runtime.backends.contract import SequenceState, Snapshot
from runtime.messages import (
    Admit,
    Generate,
    Holder,
    HolderKind,
    PromptFacts,
    Request,
    RequestKind,
    ReusePath,
    Sampling,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    TokenIds,
    Usage,
)
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.stop_strings import StopStringMatcher

if TYPE_CHECKING:
    from actors.engine.drafting import Speculation
    from runtime.text.sampling import Draw, TokenSampler


class RestoreSource(NamedTuple):
    """What a lookup hit restores from: an entry's state, and its snapshot at the hit's length.
    ``taken``: the engine took the entry at the restore (``LookupResult.takeable``,
    ``gate.may_take``): its state is cut back in place (``Backend.take_state``), not copied."""

    state: SequenceState
    snapshot: Snapshot | None
    taken: bool = False


Terminal = SequenceFinished | SequenceCancelled | SequenceFailed


class Ending(NamedTuple):
    """How a sequence ended while a step still held its state: what to do once it is back."""

    detach: bool  # commit the state to the prefix cache
    terminal: Terminal  # sent once everything is given back


@dataclass(eq=False)
class Decoding:
    """A decoding sequence's compute-thread side: what one decode step leaves for the next (which
    may run before the loop has seen the one before it: compute.py queues a lone stream's steps).

    Made on the loop when the prompt is in; from then on only decode steps touch it.
    """

    history: list[int]  # the prompt and every token read so far (the sampler's history)
    detokenizer: IncrementalDetokenizer
    read: int = 0  # tokens read so far
    sampler: TokenSampler | None = None  # built at the first draw
    ahead: Draw | None = None  # the next token: drawn after the last one was fed, not read yet
    pending: int | None = None  # the last token read, not fed yet (no step was queued on it)
    ended: bool = False  # the last token read ends the sequence (EOS, stop token, max_tokens)
    speculation: Speculation | None = None  # prompt-lookup drafting, where the request allows it


@dataclass(eq=False)
class Sequence:
    """Mutable per-sequence bookkeeping, owned by the engine core (the loop thread).

    What the request asked for is read through the frozen ``admit``, never copied. Only ``state``,
    ``decoding`` and ``rng`` are touched by the compute thread, and only while ``in_compute`` is
    set (the loop reads ``decoding`` between steps, to see who has a token to join a batch with).
    """

    admit: Admit
    model: str
    max_tokens: int  # 0 until the prompt length is known, when the request set no maximum
    stop_token_ids: frozenset[int]  # the request's, plus the model's EOS once tokenized
    tokens: TokenIds | None  # the prompt's, once given or tokenized
    rng: random.Random
    dropped_turns: int = 0
    max_tokens_clamped: bool = False  # its max_tokens was lowered to the room left in the context
    reasoning_open: bool = False  # its chat prompt ends inside an open reasoning block
    instructions_tokens: int = 0  # leading tokens that render the system messages alone
    message_ends: tuple[int, ...] = ()  # token counts where chat messages end (checkpoints)
    pin_at: int = 0  # >0: snapshot here and pin it as the session's instructions prefix
    drafts: int = 0  # the most tokens a speculative pass drafts (0: none), set at admission
    phase: Phase = Phase.TOKENIZING  # changed only by ``move``
    # Set once, by the loop, when the sequence must stop; the compute thread checks it per step.
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: str = "cancelled"
    state: SequenceState | None = None
    in_compute: bool = False
    reserved: bool = False
    lookup_sent_on: bool = False  # its Reserve carried its Lookup: the keeper sends it on
    lease_id: int | None = None
    generation: int = 0
    restore_entry: int | None = None
    restore_length: int = 0
    # A checkpoint hit's longer reach: the most of its entry the prompt shares; the restore cuts
    # back there instead where the backend still can (Backend.copy_state's ``reach``).
    reach_length: int = 0
    # An entry the disk tier read back, restored from instead of ``restore_entry``.
    disk_source: RestoreSource | None = None
    # The prefix cache allows its restore to take the leased entry (LookupResult.takeable).
    takeable: bool = False
    taken: bool = False  # it restored from a taken entry, cut back in place (Started.taken)
    from_disk: bool = False
    path: ReusePath = ReusePath.MISS
    checkpoint_rule: CheckpointRule | None = None  # None: the cache trims, no checkpoints
    checkpoints: list[int] = field(default_factory=list)  # token counts to snapshot at
    # Bytes of its KV reservation still free for snapshots (reserved with it, for them).
    snapshot_room: int = 0
    # Snapshots taken so far, covered by its reservation: points of the entry it leaves.
    snapshots: list[Snapshot] = field(default_factory=list)
    started_sent: bool = False
    cached_tokens: int = 0
    resume_phase: Phase | None = None  # set when adopting a prewarm: where to continue
    adopted_by: Sequence | None = None
    leader: Sequence | None = None  # the identical prewarm this one follows (Phase.FOLLOWING)
    generated: list[int] = field(default_factory=list)  # the tokens shown
    decoding: Decoding | None = None  # the compute thread's side, from the first decode step on
    # Built for a first draw queued behind the prompt's last chunk (compute.py's ``top_up``):
    # ``start_decoding`` takes it as ``decoding``, which that draw may be filling already.
    next_decoding: Decoding | None = None
    stop_matcher: StopStringMatcher | None = None
    batch_slot: int | None = None  # its row in the engine's decode batch, while batched
    ending: Ending | None = None  # ended while a queued step held its state: settled on its return

    @classmethod
    def admitted(cls, admit: Admit, model: str) -> Sequence:
        """A new sequence of engine ``model`` for ``admit``, before its prompt is tokenized."""
        request = admit.request.request
        seq = cls(
            admit=admit,
            model=model,
            max_tokens=request.max_tokens or 0,
            stop_token_ids=frozenset(request.stop_token_ids),
            # A moved request's tokens, as the replica it left made them (not tokenized again).
            tokens=request.prompt_tokens if admit.tokens is None else admit.tokens,
            # Unseeded requests draw from OS entropy; a seed makes the output repeatable.
            rng=random.Random(request.sampling.seed),
        )
        if admit.facts is not None:
            seq.instructions_tokens = admit.facts.instructions_tokens
            seq.message_ends = admit.facts.message_ends
            seq.dropped_turns = admit.facts.dropped_turns
            seq.reasoning_open = admit.facts.reasoning_open
        return seq

    def move(self, to: Phase) -> None:
        """Go to phase ``to``; raises ``IllegalMove`` unless lifecycle.py's table allows it."""
        check_move(self.sequence_id, self.phase, to)
        self.phase = to

    def facts(self) -> PromptFacts:
        """What rendering its chat prompt found (defaults for a plain prompt)."""
        return PromptFacts(
            instructions_tokens=self.instructions_tokens,
            message_ends=self.message_ends,
            dropped_turns=self.dropped_turns,
            reasoning_open=self.reasoning_open,
        )

    # ------------------------------------------------------------------ the request, read through

    @property
    def request(self) -> Request:
        """What the request asked for: one value, a prewarm's generate-only fields at their
        defaults (runtime/messages/request.py)."""
        return self.admit.request.request

    @property
    def sequence_id(self) -> int:
        return self.admit.sequence_id

    @property
    def epoch(self) -> int:
        return self.admit.epoch

    @property
    def session(self) -> str:
        return self.admit.session

    @property
    def namespace(self) -> str:
        return self.request.namespace

    @property
    def kind(self) -> RequestKind:
        generate = isinstance(self.admit.request, Generate)
        return RequestKind.GENERATE if generate else RequestKind.PREWARM

    @property
    def sampling(self) -> Sampling:
        return self.request.sampling

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self.request.stop

    @property
    def supersede(self) -> bool:
        """Whether this is a generate that aborts its session's older generates (a keystroke)."""
        return self.request.supersede

    @property
    def anonymous(self) -> bool:
        """Whether its client cannot be told from others': it supersedes nothing, nor is
        superseded (the HTTP server's requests without a session)."""
        return self.request.anonymous

    @property
    def reuse_prefix(self) -> bool:
        """Whether it may restore cached state (a lookup hit, an adopted prewarm); a generate
        sent with ``reuse_prefix=False`` prefills its whole prompt."""
        return self.request.reuse_prefix

    # ------------------------------------------------------------------ the engine's view

    @property
    def holder(self) -> Holder:
        return Holder(
            model=self.model, epoch=self.epoch, kind=HolderKind.SEQUENCE, id=self.sequence_id
        )

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill: the whole prompt, or for a prewarm all but the last (design.md)."""
        assert self.tokens is not None
        if self.kind is RequestKind.PREWARM:
            return max(len(self.tokens) - 1, 0)
        return len(self.tokens)

    @property
    def prefill_rest(self) -> int:
        """Prompt tokens still to prefill (its state holds the others)."""
        assert self.state is not None
        return self.prefill_target - self.state.length

    @property
    def awaits_first_draw(self) -> bool:
        """Its prompt is in and its first token is yet to be drawn (that draw ends its TTFT)."""
        return (
            self.phase is Phase.DECODING and self.decoding is not None and self.decoding.read == 0
        )

    @property
    def cache_tokens(self) -> TokenIds:
        """The tokens its cache holds, in order (the first ``state.length`` of these): the prompt
        and every token a decode step read, shown or not (an EOS, one read as an abort landed)."""
        assert self.tokens is not None
        return self.tokens if self.decoding is None else tuple(self.decoding.history)

    def usage(self) -> Usage:
        speculation = None if self.decoding is None else self.decoding.speculation
        return Usage(
            prompt_tokens=len(self.tokens or ()),
            cached_prompt_tokens=self.cached_tokens,
            completion_tokens=len(self.generated),
            max_tokens_clamped_to=self.max_tokens if self.max_tokens_clamped else None,
            drafted_tokens=0 if speculation is None else speculation.drafted,
            accepted_tokens=0 if speculation is None else speculation.accepted,
        )

    def live_successor(self) -> Sequence:
        """The sequence that now owns this one's work (itself unless a generate adopted it)."""
        seq = self
        while seq.adopted_by is not None:
            seq = seq.adopted_by
        return seq


def release_draft(seq: Sequence) -> None:
    """Drop ``seq``'s draft-model state, if it has one (idempotent; no step may hold it)."""
    speculation = None if seq.decoding is None else seq.decoding.speculation
    if speculation is not None and speculation.source is not None:
        speculation.source.close()


def release_matcher(seq: Sequence) -> None:
    """Drop ``seq``'s constraint grammar state, if it has one (idempotent; no step may hold it)."""
    sampler = None if seq.decoding is None else seq.decoding.sampler
    if sampler is not None and sampler.matcher is not None:
        sampler.matcher.release()
