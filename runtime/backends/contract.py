"""The contract between an engine and a model backend (MLX, llama.cpp or simulated).

Every method runs on the engine's compute thread, never on the event loop. A backend owns the
model; a ``SequenceState`` is an opaque per-sequence cache the engine hands back to it. The engine
never looks inside states: it asks the backend to copy, trim, measure and extend them. A backend
that can also write states to the prefix cache's disk tier implements
``runtime.backends.disk.host.Persistent`` beside this contract (MLX, llama.cpp and the
simulated backend do).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

from runtime.backends.options import ModelOptions
from runtime.messages import ChatMessage, ModelSpec
from runtime.text.chat import ChatTokenizer

if TYPE_CHECKING:  # logits are MLX arrays; the contract itself needs no MLX to import
    import threading

    import mlx.core as mx

    from runtime.text.constraints import ConstraintEngine


class ReuseStrategy(enum.StrEnum):
    """Which prefix-reuse path a model's cache allows, decided once per load."""

    TRIM = "trim"  # every layer's cache can be cut back to any shorter prefix
    CHECKPOINT = "checkpoint"  # some layer cannot be trimmed: reuse only whole snapshots
    NONE = "none"  # nothing can be reused safely


class Capability(enum.StrEnum):
    """A behaviour the engine relies on that the load probe checks on the model itself."""

    SNAPSHOT_REACH_BACK = "snapshot_reach_back"  # a snapshot taken inside a pass restores exactly
    BATCH_PREFILL = "batch_prefill"  # a padded batched prefill equals each prompt alone
    BATCH_DECODE = "batch_decode"  # a batched decode step equals each row's own step
    TRIM = "trim"  # a state cut back, then extended, equals the same tokens computed anew


class Verdict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The load probe's finding on one capability: on or off, and one sentence why (with the
    largest logit difference it measured, when it compared logits)."""

    capability: Capability
    on: bool
    why: str
    max_diff: float | None = None


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Facts about a loaded model the engine schedules and prices by."""

    context_length: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    reuse: ReuseStrategy
    reuse_reason: str
    bytes_per_token: int  # per token of full-attention KV
    window_tokens: int | None = None  # sliding-window layers hold at most this many tokens
    window_bytes_per_token: int = 0
    fixed_state_bytes: int = 0  # recurrent state, independent of length
    # A state that never held this many tokens still trims (0: no such bound): llama.cpp's
    # sliding-window cells before the window fills. A generate that stays under it takes no
    # checkpoints (actors/engine/checkpoints.py, ``CheckpointPolicy.rule``).
    trims_below: int = 0
    alloc_step: int = 1  # KV caches grow in steps of this many tokens (mlx-lm: 256)
    # The most tokens past a reuse point the engine gives up to *take* an entry nobody else holds
    # (``take_state``: cut back in place, the entry leaves the cache) instead of copying it; 0:
    # never (the backend has no separate copy worth saving). What the threshold weighs:
    # docs/reuse.md, "Taking an entry instead of copying it".
    take_tail_tokens: int = 0
    # Seconds of a one-token pass that keeps no logits, measured at load: the fixed cost every
    # prefill pass pays (reading the weights, launching each layer), whatever its length.
    pass_s: float = 0.0
    # How many evenly spread points of a prefill pass check its stop flag (one per attention
    # layer on MLX, when every cache can be put back); 0: none, or not reported.
    stop_checks: int = 0
    # The longest prompt ``prefill_together`` takes snapshots inside (0: it takes none; on MLX
    # any prompt, but none where sliding-window layers sit beside recurrent ones: together.py).
    together_snapshot_tokens: int = 0
    # The tokenizer has a chat template; without one chat messages get the plain fallback format
    # (runtime/text/chat.py) and `mlxrt generate`/`chat` send raw text instead (docs/chat.md).
    chat_template: bool = True
    # The load probe's verdicts (empty: not probed, everything taken as it is declared).
    capabilities: tuple[Verdict, ...] = ()
    probe_s: float = 0.0  # seconds the probe took when it ran (perhaps at an earlier load)
    probe_cached: bool = False  # this load took the verdict from the cache: it ran no probe
    # The probe has not given its verdict yet: every capability is off until the engine has run
    # the backend's ``deferred_probe`` (while idle), which returns the info to use from then on.
    probe_pending: bool = False
    # The backend implements ``verify``/``rewind``: speculative decoding may run on it (False: a
    # request's drafts are ignored and it decodes one token per pass).
    verifies: bool = True
    # Bytes of the model's weights (0: not known): what a draft model's pass costs against its
    # target's is taken as their ratio (actors/engine/draft_model.py).
    weight_bytes: int = 0

    def capable(self, capability: Capability) -> bool:
        """Whether ``capability`` may be used (one the probe did not judge is on)."""
        return all(v.on for v in self.capabilities if v.capability is capability)

    @property
    def limits(self) -> dict[str, str]:
        """The capabilities switched off for this model, each with why."""
        return {str(v.capability): v.why for v in self.capabilities if not v.on}

    @property
    def snapshot_bytes(self) -> int:
        """The most one ``Snapshot`` holds, whatever the length: a window per sliding layer and
        the recurrent state (full-attention layers are cut back instead of copied)."""
        return (self.window_tokens or 0) * self.window_bytes_per_token + self.fixed_state_bytes

    def kv_bytes(self, n_tokens: int, chunk_tokens: int = 1) -> int:
        """Bytes of cache a sequence of ``n_tokens`` needs, from the model's real layout.

        Full-attention layers are priced in whole allocation steps, as they really grow. A
        sliding-window layer fed ``chunk_tokens`` at a time holds up to window - 1 + chunk tokens
        (the chunk attends to the window before it), and while it decodes below its window it
        grows in whole steps too.
        """
        allocated = -(-n_tokens // self.alloc_step) * self.alloc_step
        windowed = n_tokens
        if self.window_tokens is not None:
            # A chunk attends to the window before it; a one-token update grows the ring by a
            # whole step up to the window (mlx-lm's RotatingKVCache), so either can be larger.
            windowed = max(
                min(n_tokens, self.window_tokens - 1 + max(1, chunk_tokens)),
                min(allocated, self.window_tokens),
            )
        return (
            self.bytes_per_token * allocated
            + self.window_bytes_per_token * windowed
            + self.fixed_state_bytes
        )


class SequenceState(Protocol):
    """Opaque cache of one sequence; ``length`` is how many tokens it has consumed."""

    @property
    def length(self) -> int: ...


class Snapshot(Protocol):
    """A copy of only the layers of a state that cannot be trimmed back, at ``length`` tokens.

    On a model that mixes full-attention layers with sliding-window or recurrent ones, a checkpoint
    needs just this: the full-attention layers of the same token prefix are cut back from a longer
    state that went through it (see ``Backend.copy_state``). On a model whose every layer is
    untrimmable it is the whole state; on one whose every layer trims, it is empty.
    """

    @property
    def length(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


class DecodeBatchHandle(Protocol):
    """Sequences decoded together, one token each per ``step`` (``runtime.backends.mlx.batch``)."""

    def join(self, state: SequenceState) -> int:
        """Add a prefilled sequence (its state is copied in and left untouched); a slot id."""
        ...

    def leave(self, slot: int) -> SequenceState:
        """Take a sequence out, as an independent state (its logits included)."""
        ...

    def step(
        self, tokens: Mapping[int, int | mx.array], argmax: Collection[int] = ()
    ) -> Mapping[int, mx.array | int]:
        """Feed one token to every member (a token id, or a scalar array not read yet); each
        member's next logits, which MLX has not computed yet (see ``Backend.pipelined``). For a
        slot in ``argmax`` (a plain greedy sampler's) a backend may give the id of its largest
        logit instead (the first of equal ones), which llama.cpp reads without copying the row."""
        ...

    def __len__(self) -> int: ...


class DeferredProbe(Protocol):
    """A load probe that runs after the model is serving, one bounded piece per call."""

    def step(self) -> ModelInfo | None:
        """Run one piece (a few short passes): None while more remain, else the model's info
        with the verdict applied, which the engine uses from then on."""
        ...


class CannotTrim(Exception):
    """Raised by ``copy_state`` when a state cannot be cut back to the requested length."""


class PrefillInterrupted(Exception):
    """Raised by ``prefill`` that gave up once its ``stop`` was set; the state is as before, or
    (``kept``) at the last snapshot point the call passed, with ``snapshots`` taken up to there."""

    def __init__(self, message: str, kept: int = 0, snapshots: Sequence[Snapshot] = ()) -> None:
        super().__init__(message)
        self.kept, self.snapshots = kept, tuple(snapshots)


class Backend(Protocol):
    """What an engine needs from a model. Implementations: ``mlx.backend``, ``llamacpp.backend``,
    ``simulated``."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def chat_tokenizer(self) -> ChatTokenizer:
        """What ``runtime.text.chat.prepare_chat`` renders and tokenizes chat messages with."""
        ...

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt (adding the model's BOS if it uses one)."""
        ...

    def prepare_media(self, messages: tuple[ChatMessage, ...]) -> tuple[ChatMessage, ...]:
        """Chat ``messages`` ready for ``prepare_chat``: a vision-language model decodes, checks
        and registers their images (and a video's sampled frames) and keys them into the text
        (runtime/backends/vision/); a text-only one returns them as they are, or raises
        ``MediaUnsupported`` when one has an image or video (so does an image-only family for a
        video). Raises ``InvalidMedia``, ``TooManyImages``, ``TooManyFrames`` or
        ``InvalidRequest`` for bad media.
        """
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Detokenize (may end in U+FFFD while a character is incomplete)."""
        ...

    def new_state(self) -> SequenceState:
        """An empty cache."""
        ...

    def can_trim(self, state: SequenceState) -> bool:
        """Whether ``state`` could be cut back to a shorter prefix (decides how it is cached)."""
        ...

    def copy_state(
        self,
        state: SequenceState,
        length: int,
        snapshot: Snapshot | None = None,
        *,
        reach: int = 0,
    ) -> SequenceState:
        """An independent copy of ``state``'s first ``length`` tokens; raises ``CannotTrim``.

        With ``snapshot`` (taken by ``snapshot`` at ``length`` tokens of this state's own history)
        the untrimmable layers come from it and only the trimmable ones are cut back, so a state
        that cannot be trimmed as a whole can still be restored at any of its snapshots.

        ``reach`` (more than ``length``, at most the state's length): a longer prefix the caller
        would rather have. A backend whose state still holds everything a cut back to ``reach``
        needs (llama.cpp's sliding-window layers keep cells past their window until reused) cuts
        there instead, without the snapshot; the returned state's ``length`` says which it gave.
        """
        ...

    def take_state(
        self,
        state: SequenceState,
        length: int,
        snapshot: Snapshot | None = None,
        *,
        reach: int = 0,
    ) -> SequenceState:
        """``state``'s first ``length`` tokens as ``copy_state`` gives them, made from ``state``
        itself where the backend can (cut back in place: no copy), which the caller gives up
        (it is changed, or returned); raises ``CannotTrim``, after which ``state`` is unusable.
        """
        ...

    def snapshot(self, state: SequenceState) -> Snapshot:
        """A copy of ``state``'s untrimmable layers at its current length (see ``Snapshot``)."""
        ...

    def prefill(
        self,
        state: SequenceState,
        token_ids: Sequence[int],
        *,
        logits: bool = True,
        snapshot_at: Sequence[int] = (),
        stop: threading.Event | None = None,
    ) -> Sequence[Snapshot]:
        """Run ``token_ids`` through the model, extending ``state``; snapshots at ``snapshot_at``.

        With ``logits`` the logits after the last token are kept for ``logits()``; without, none
        are computed (a chunk that more of the prompt follows: projecting every position onto the
        vocabulary can cost as much as the rest of the model). ``snapshot_at`` are sorted lengths
        after the state's length and at most its new length; the snapshot at each (as ``snapshot``
        would have taken it there) is returned in that order. The backend ends its passes where it
        must to reach them; the engine never cuts a chunk for a snapshot. Once ``stop`` is set
        (the sequence's abort flag) the backend may give up inside the call: it then raises
        ``PrefillInterrupted``, ``state`` as it was before the call or as its ``kept`` says.
        """
        ...

    def prefill_together(
        self,
        states: Sequence[SequenceState],
        token_ids: Sequence[Sequence[int]],
        snapshot_at: Sequence[Sequence[int]] = (),
    ) -> Sequence[Sequence[Snapshot]]:
        """Extend each state in ``states`` (empty, or holding a cached prefix) with its
        ``token_ids`` (2 or more), in one batched pass where the backend can, keeping the logits
        after each one's last token.

        Only asked of a backend whose ``open_batch`` gave a batch (its caches batch). Costs each
        prompt less than its own ``prefill`` where a pass reads the weights once for all rows. Not
        interruptible. ``snapshot_at``: empty, or one list of points per state as ``prefill``
        takes them; only of states whose prompt ends within ``ModelInfo.together_snapshot_tokens``
        (``ValueError`` otherwise). Returns the snapshots, one list per state.
        """
        ...

    def logits(self, state: SequenceState) -> mx.array:
        """The float32 ``(vocab,)`` logits after the last prefilled token (samplers act on them)."""
        ...

    def verify(self, state: SequenceState, token_ids: Sequence[int]) -> mx.array:
        """Run ``token_ids`` (2 or more: a token and the drafts after it) through the model in one
        pass, extending ``state``; the float32 ``(len(token_ids), vocab)`` logits after each of
        them, computed. Follow it with ``rewind`` before any other use of ``state``.
        """
        ...

    def rewind(self, state: SequenceState, keep: int) -> None:
        """After ``verify`` (or ``draft``): keep only the first ``keep`` (1 or more) of the tokens
        it fed, as if only they had been prefilled (``logits()`` after the last one). Layers that
        cannot be cut back are restored from what they were before the pass, and the kept tokens
        run again; raises ``ValueError`` when no ``verify`` or ``draft`` precedes it or ``keep``
        is out of range."""
        ...

    def draft(self, state: SequenceState, token_ids: Sequence[int], n: int) -> list[int]:
        """The draft model's side of speculation: run ``token_ids`` (1 or more, the tokens
        ``state`` lacks of a sequence's history) and then ``n`` greedy tokens after them, feeding
        all but the last; returns the ``n`` tokens. Follow it with ``rewind`` (keeping at least
        ``token_ids``) before any other use of ``state``. Only on a model whose every layer cuts
        back (full attention: ``ValueError`` otherwise)."""
        ...

    def vocabulary(self) -> Sequence[str]:
        """Each token id's token as the tokenizer spells it (a draft model must have the same)."""
        ...

    @property
    def pipelined(self) -> bool:
        """Whether the engine pipelines decode steps here: it builds the step that feeds a drawn
        token before reading the token (``feed``, ``DecodeBatchHandle.step``; MLX: its arrays
        compute when evaluated). Where not, every logits array a backend returns is computed
        already, and a sampler may read it on the host at once (``TokenSampler.draw``)."""
        ...

    @property
    def queues_steps(self) -> bool:
        """Whether the engine queues a lone stream's next decode step behind its running one, so
        the compute thread goes from one token to the next without waiting for the event loop
        (MLX, llama.cpp; ``ComputeSlot.top_up``). The queued step feeds what the running one
        left: its draw (pipelined) or the token it read."""
        ...

    @property
    def decode_block(self) -> int:
        """How many tokens a lone stream's decode step may read back to back on the compute
        thread (1 on a pipelined backend, whose steps are built ahead instead): the event loop
        sees them together (actors/engine/decode.py)."""
        ...

    def feed(self, state: SequenceState, token: mx.array) -> mx.array:
        """``prefill`` of one token given as a scalar array, possibly not read yet (a sampler's
        draw); returns the next float32 ``(vocab,)`` logits, which MLX has not computed yet."""
        ...

    def open_batch(self) -> DecodeBatchHandle | None:
        """A decode batch for this model, or None when its caches cannot be batched."""
        ...

    def state_nbytes(self, state: SequenceState) -> int:
        """Actual bytes the state's cache occupies."""
        ...

    def constraint_engine(self) -> ConstraintEngine | None:
        """The grammar engine over this model's vocabulary (made at the first call), or None
        when the backend cannot constrain its output."""
        ...

    def deferred_probe(self) -> DeferredProbe | None:
        """The load probe left to run while the engine is idle (``ModelInfo.probe_pending``),
        handed over once (asked right after the load), or None."""
        ...

    def tidy(self) -> bool:
        """One bounded piece of housekeeping that would otherwise land on a later request's way
        to its first token (llama.cpp: moving an idle state to host memory so a sequence slot
        is free), run on the compute thread once the engine has been idle a while; True when
        it did some (the engine asks again), False when nothing is left to do."""
        ...

    def close(self) -> None:
        """Free the model and its buffers (called on the compute thread at unload)."""
        ...


# Loads a model with the options the engine decoded from its spec (each kind gets its own struct).
BackendLoader = Callable[[ModelSpec, ModelOptions], Backend]
