"""The engine's compute jobs (with decode.py: the only code that runs on its compute thread).

A job touches the backend, its own record and the one sequence state it was given, and never
raises: errors are handed back in the record, which the engine reads on the event loop after
``ComputeDone`` arrives (the executor's hand-off orders the two). Each kind of job has its own
record type, so a job carries only its own fields; ``Job`` is their union.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.engine.checkpoints import plan_checkpoints
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import (
    Backend,
    BackendLoader,
    CannotTrim,
    DecodeBatchHandle,
    ReuseStrategy,
    SequenceState,
    Snapshot,
)
from runtime.backends.options import DEFAULT_CHECKPOINT_EVERY, ModelOptions
from runtime.messages import ModelSpec, TokenLogprob
from runtime.text.chat import PreparedPrompt, prepare_chat

if TYPE_CHECKING:
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
    fed: bool = False  # ``token`` is in the cache already: the step after it was built
    ahead_error: BaseException | None = None  # building that step failed (after ``token``)
    queued: bool = False  # a decode step queued behind the running one of the same sequence
    state: SequenceState | None = None
    error: BaseException | None = None
    skipped: bool = False  # the abort flag was already set when the job started
    fallback: str | None = None
    pin_copy: SequenceState | None = None  # the session's instructions prefix, whole
    snapshot: Snapshot | None = None  # a checkpoint's untrimmable layers
    checkpoints: list[int] | None = None


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


@dataclass(frozen=True)
class StepPlan:
    """How an engine cuts prefills: chunk size, and snapshot spacing for non-trimmable caches."""

    chunk_tokens: int
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY


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
    plan: StepPlan,
    restore_source: RestoreSource | None,
) -> None:
    """One restore or prefill chunk of ``seq``, unless its abort flag is set (a decode step is
    ``decode.run_decode``)."""
    if seq.abort.is_set():
        job.skipped = True
        return
    try:
        if seq.phase is Phase.RESTORING:
            job.state = _restore(job, seq, backend, plan, restore_source)
        else:
            _prefill_chunk(job, seq, backend, plan)
    except BaseException as exc:
        job.error = exc


def _restore(
    job: StepJob,
    seq: Sequence,
    backend: Backend,
    plan: StepPlan,
    source: RestoreSource | None,
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
    if backend.info.reuse is ReuseStrategy.CHECKPOINT and seq.tokens is not None:
        points = plan_checkpoints(
            seq.tokens,
            state.length,
            seq.prefill_target,
            plan.checkpoint_every,
            backend.decode,
            instructions_end=seq.instructions_tokens,
        )
    if state.length < seq.pin_at < seq.prefill_target and seq.pin_at not in points:
        points = sorted([*points, seq.pin_at])  # the session's instructions, on any cache kind
    job.checkpoints = points
    return state


def _prefill_chunk(job: StepJob, seq: Sequence, backend: Backend, plan: StepPlan) -> None:
    assert seq.state is not None
    assert seq.tokens is not None
    start = seq.state.length
    end = min(start + plan.chunk_tokens, seq.prefill_target)
    if seq.checkpoints:  # land exactly on the next checkpoint
        end = min(end, seq.checkpoints[0])
    backend.prefill(seq.state, seq.tokens[start:end])
    job.prefilled = end - start
    if seq.checkpoints and end == seq.checkpoints[0]:
        if end == seq.pin_at:
            job.pin_copy = backend.copy_state(seq.state, end)
        else:
            job.snapshot = backend.snapshot(seq.state)
