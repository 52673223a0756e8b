"""The engine's compute jobs: the only code that runs on its compute thread.

A job touches the backend, its own record and the one sequence state it was given, and never
raises: errors are handed back in the record, which the engine reads on the event loop after
``ComputeDone`` arrives (the executor's hand-off orders the two). Each kind of job has its own
record type, so a job carries only its own fields; ``Job`` is their union.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.engine.checkpoints import plan_checkpoints
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import (
    Backend,
    BackendLoader,
    CannotTrim,
    DecodeBatchHandle,
    PrefillInterrupted,
    SequenceState,
    Snapshot,
)
from runtime.backends.options import ModelOptions
from runtime.messages import ModelSpec, RequestKind, TokenLogprob
from runtime.text.chat import PreparedPrompt, prepare_chat

if TYPE_CHECKING:
    import mlx.core as mx

    from actors.engine.entries import RestoreSource


@dataclass
class BatchWork:
    """One batched decode step: who leaves first, who joins, who was already in."""

    leavers: list[Sequence]
    joiners: list[Sequence]
    members: list[Sequence]


@dataclass
class LoadJob:
    """Load the model, and ask once whether it can batch."""

    backend: Backend | None = None
    batchable: bool = False
    error: BaseException | None = None


@dataclass
class TokenizeJob:
    """Tokenize the prompts of the sequences admitted so far, by sequence id."""

    results: dict[int, list[int]] = field(default_factory=dict)
    prepared: dict[int, PreparedPrompt] = field(default_factory=dict)  # chat prompts only
    failures: dict[int, BaseException] = field(default_factory=dict)


@dataclass
class StepJob:
    """One restore, prefill chunk or decode step of ``seq`` (or its row of a batch step)."""

    seq: Sequence
    prefilled: int = 0
    token: int | None = None
    text: str = ""
    logprob: TokenLogprob | None = None
    state: SequenceState | None = None
    error: BaseException | None = None
    skipped: bool = False  # the abort flag stopped it: before it began, or mid-chunk (undone)
    fallback: str | None = None
    chunk_tokens: int = 0  # a prefill chunk's most tokens (set by the loop when it submits one)
    pin_copy: SequenceState | None = None  # the session's instructions prefix, whole
    snapshots: list[Snapshot] = field(default_factory=list)  # checkpoints' untrimmable layers
    checkpoints: list[int] | None = None
    passed: int = 0  # checkpoints (pin included) the chunk went past: each left one of the two


@dataclass
class BatchJob:
    """One step of the decode batch: ``work`` says who leaves, joins and steps."""

    work: BatchWork
    batch: DecodeBatchHandle | None = None
    left: dict[int, SequenceState] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)
    stepped: dict[int, StepJob] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass
class CloseJob:
    """Close the backend: compute has stopped for good."""


Job = LoadJob | TokenizeJob | StepJob | BatchJob | CloseJob


def run_load(
    job: LoadJob, load_backend: BackendLoader, spec: ModelSpec, options: ModelOptions
) -> None:
    """Load the model with the options the engine decoded (the backend does not decode again)."""
    try:
        job.backend = load_backend(spec, options)
        # Asked once: a model mlx-lm cannot batch (kv_bits, chunked caches) stays on B=1 for good.
        job.batchable = job.backend.open_batch() is not None
    except BaseException as exc:
        job.error = exc


def run_tokenize(job: TokenizeJob, seqs: list[Sequence], backend: Backend) -> None:
    """Tokenize prompts, rendering chat messages through the one shared preparation path."""
    for seq in seqs:
        try:
            request = seq.request
            if request.messages is None:
                job.results[seq.sequence_id] = backend.encode(request.prompt or "")
                continue
            # The window and the context check use the request's own max_tokens (a prewarm
            # passes the one its generate will use), so both render the same tokens.
            reply_room = seq.max_tokens or 1
            prepared = prepare_chat(
                backend.chat_tokenizer,
                request.messages,
                request.chat,
                min(reply_room, backend.info.context_length - 1),
                backend.info.context_length,
            )
            job.results[seq.sequence_id] = list(prepared.tokens)
            job.prepared[seq.sequence_id] = prepared
        except BaseException as exc:
            job.failures[seq.sequence_id] = exc


def run_step(
    job: StepJob,
    seq: Sequence,
    backend: Backend,
    restore_source: RestoreSource | None,
) -> None:
    """One restore, prefill chunk or decode step of ``seq``, unless its abort flag is set."""
    if seq.abort.is_set():
        job.skipped = True
        return
    try:
        if seq.phase is Phase.RESTORING:
            job.state = _restore(job, seq, backend, restore_source)
        elif seq.phase is Phase.PREFILLING:
            _prefill_chunk(job, seq, backend)
        else:
            _decode_step(job, seq, backend)
    except BaseException as exc:
        job.error = exc


def _restore(
    job: StepJob, seq: Sequence, backend: Backend, source: RestoreSource | None
) -> SequenceState:
    if seq.state is not None:  # adopted from a prewarm
        state = seq.state
    elif source is None:
        state = backend.new_state()
    else:
        try:
            state = backend.copy_state(source.state, seq.restore_length, source.snapshot)
        except CannotTrim:
            job.fallback = "trim_refused"
            state = backend.new_state()
    points: list[int] = []
    if seq.checkpoint_rule is not None and seq.tokens is not None:
        points = plan_checkpoints(
            seq.tokens,
            state.length,
            seq.prefill_target,
            backend.decode,
            seq.checkpoint_rule,
            message_ends=seq.message_ends,
            instructions_end=seq.instructions_tokens,
        )
    if state.length < seq.pin_at < seq.prefill_target and seq.pin_at not in points:
        points = sorted([*points, seq.pin_at])  # the session's instructions, on any cache kind
    job.checkpoints = points
    return state


def _prefill_chunk(job: StepJob, seq: Sequence, backend: Backend) -> None:
    assert seq.state is not None
    assert seq.tokens is not None
    start = seq.state.length
    end = min(start + job.chunk_tokens, seq.prefill_target)
    points = [p for p in seq.checkpoints if p <= end]
    # Logits only once the whole prompt is in: a generate samples from them next.
    logits = end == len(seq.tokens) and seq.kind is RequestKind.GENERATE
    try:
        taken = backend.prefill(
            seq.state, seq.tokens[start:end], logits=logits, snapshot_at=points, stop=seq.abort
        )
    except PrefillInterrupted:  # aborted meanwhile: the state is as before the chunk
        job.skipped = True
        return
    job.prefilled, job.passed = end - start, len(points)
    for point, snapshot in zip(points, taken, strict=True):
        if point == seq.pin_at:  # the instructions prefix: the whole state there, its own entry
            job.pin_copy = backend.copy_state(seq.state, point, snapshot)
        else:
            job.snapshots.append(snapshot)


def _decode_step(job: StepJob, seq: Sequence, backend: Backend) -> None:
    """Feed the last emitted token (if any), then sample the next one and its text."""
    assert seq.state is not None
    if seq.pending_token is not None:
        backend.prefill(seq.state, [seq.pending_token])
        job.prefilled = 1
    sample_into(job, seq, backend, backend.logits(seq.state))


def sample_into(job: StepJob, seq: Sequence, backend: Backend, logits: mx.array) -> None:
    """Pick ``seq``'s next token from ``logits``, with its text (and logprob when asked)."""
    assert seq.detokenizer is not None
    if seq.sampler is None:
        # Imported at the first sample, not with the engine: it imports mlx-lm (and transformers),
        # which loading a simulated model does not need.
        from runtime.text.sampling import TokenSampler

        seq.sampler = TokenSampler(seq.sampling, int(logits.shape[0]), _token_decoder(backend))
    sampled = seq.sampler.sample(logits, seq.all_tokens, seq.rng)
    job.token = sampled.token
    if seq.sampling.logprobs:
        job.logprob = TokenLogprob(
            token=sampled.token, logprob=sampled.logprob or 0.0, top=sampled.top_logprobs
        )
    ending = job.token in seq.stop_token_ids
    if not ending:
        job.text = seq.detokenizer.add(job.token)
    if ending or seq.on_last_step:
        job.text += seq.detokenizer.flush()  # the stream ends: release any held-back bytes


def run_batch(job: BatchJob, backend: Backend, batch: DecodeBatchHandle | None) -> None:
    """Leave, join, then one forward pass for every member; a member aborted meanwhile leaves."""
    try:
        if batch is None:
            batch = backend.open_batch()
            if batch is None:
                raise RuntimeError("this model's caches cannot be batched")
        job.batch = batch
        work = job.work
        for seq in work.leavers:
            assert seq.batch_slot is not None
            job.left[seq.sequence_id] = batch.leave(seq.batch_slot)
        slots: dict[int, Sequence] = {}
        for seq in work.members:
            assert seq.batch_slot is not None
            if seq.abort.is_set():
                job.left[seq.sequence_id] = batch.leave(seq.batch_slot)
            else:
                slots[seq.batch_slot] = seq
        for seq in work.joiners:
            if seq.abort.is_set():
                continue
            assert seq.state is not None
            slot = batch.join(seq.state)
            job.joined[seq.sequence_id] = slot
            slots[slot] = seq
        if not slots:
            return
        tokens = {slot: seq.pending_token for slot, seq in slots.items()}
        logits = batch.step({slot: t for slot, t in tokens.items() if t is not None})
        for slot, seq in slots.items():
            step = StepJob(seq, prefilled=1)
            sample_into(step, seq, backend, logits[slot])
            job.stepped[seq.sequence_id] = step
    except BaseException as exc:
        job.error = exc


def _token_decoder(backend: Backend) -> Callable[[int], str]:
    """One stable callable per backend, so the sampler's sequence-breaker cache is shared."""
    cached: Callable[[int], str] | None = getattr(backend, "_token_decoder", None)
    if cached is None:

        def cached(token: int) -> str:
            return backend.decode([token])

        setattr(backend, "_token_decoder", cached)  # noqa: B010
    return cached
