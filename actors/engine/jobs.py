"""The engine's compute jobs (with decode.py: the only code that runs on its compute thread).

A job touches the backend, its own record and the one sequence state it was given, and never
raises: errors are handed back in the record, which the engine reads on the event loop after
``ComputeDone`` arrives (the executor's hand-off orders the two). Each kind of job has its own
record type, so a job carries only its own fields; ``Job`` is their union.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.engine.checkpoints import plan_checkpoints
from actors.engine.disk_tier import ExportJob, ScanJob
from actors.engine.draft_model import DraftModel, load_draft
from actors.engine.sequence import Decoding, Phase, Sequence
from runtime.backends.contract import (
    Backend,
    BackendLoader,
    CannotTrim,
    DecodeBatchHandle,
    DeferredProbe,
    ModelInfo,
    PrefillInterrupted,
    SequenceState,
    Snapshot,
)
from runtime.backends.options import ModelOptions
from runtime.backends.vision.media import past_span
from runtime.messages import ModelSpec, RequestKind, TokenLogprob
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
    """Load the model, and ask once whether it can batch and whether its probe is left to run."""

    backend: Backend | None = None
    draft: DraftModel | None = None  # the model's draft model (``draft_model``), if it has one
    batchable: bool = False
    probe: DeferredProbe | None = None
    error: BaseException | None = None
    disk: ScanJob | None = None  # the disk tier, opened right after the model (disk_tier.py)


@dataclass
class ProbeJob:
    """One piece of the model's deferred load probe, run while nothing else waits; once the
    last is done, ``info`` is the model's from then on and ``batchable`` is asked anew."""

    probe: DeferredProbe
    info: ModelInfo | None = None
    batchable: bool = False
    error: BaseException | None = None


@dataclass
class TidyJob:
    """One piece of the backend's idle housekeeping (``Backend.tidy``): whether it did some."""

    did: bool = False
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
    completes_constraint: bool = False  # ``token`` completed the grammar: nothing may follow
    ahead_error: BaseException | None = None  # building that step failed (after ``token``)
    queued: bool = False  # a decode step queued behind the running one of the same sequence
    # A first draw queued behind the prompt's last chunk: the decoding it fills (the loop takes
    # it at the chunk's outcome, Sequence.next_decoding); it draws only if the prompt is all in.
    first: Decoding | None = None
    ends_prompt: bool = False  # a prefill chunk that prefills the rest of the prompt
    # False: a first draw that went ahead of decode work (turns.py) builds nothing past its token:
    # the sequence joins the batch next, and a step of its own would only delay the others.
    build_ahead: bool = True
    # Set by the loop when other work waits for the compute slot: a decode step reading a block
    # of tokens (Backend.decode_block) stops after the token it is on.
    yield_to: threading.Event | None = None
    state: SequenceState | None = None
    error: BaseException | None = None
    skipped: bool = False  # the abort flag stopped it: before it began, or mid-chunk (undone)
    fallback: str | None = None
    chunk_tokens: int = 0  # a prefill chunk's most tokens (set by the loop when it submits one)
    pin_copy: SequenceState | None = None  # the session's instructions prefix, whole
    snapshots: list[Snapshot] = field(default_factory=list)  # checkpoints' untrimmable layers
    checkpoints: list[int] | None = None
    passed: int = 0  # checkpoints (pin included) the chunk went past: each left one of the two
    # A speculative step's tokens after ``token``, each read as a step of its own (speculate.py).
    more: list[StepJob] = field(default_factory=list)
    drafted: int = 0  # drafts its verification pass fed
    accepted: int = 0  # of them, those its tokens agreed with


@dataclass
class BatchJob:
    """One step of the decode batch: ``work`` says who leaves, joins and steps."""

    work: BatchWork
    batch: DecodeBatchHandle | None = None
    left: dict[int, SequenceState] = field(default_factory=dict)
    joined: dict[int, int] = field(default_factory=dict)
    stepped: dict[int, StepJob] = field(default_factory=dict)
    error: BaseException | None = None
    yield_to: threading.Event | None = None  # as StepJob's: a block of steps ends early


@dataclass
class TogetherJob:
    """The rest of several generates' prompts (past what each restored) prefilled in one batched
    pass (``Backend.prefill_together``): a ``StepJob`` each, as if each had run its rest as one
    chunk (compute.py groups them)."""

    steps: list[StepJob]


@dataclass
class CloseJob:
    """Close the backend: compute has stopped for good."""


Job = (
    LoadJob
    | TokenizeJob
    | StepJob
    | TogetherJob
    | BatchJob
    | ProbeJob
    | TidyJob
    | CloseJob
    | ExportJob
)


def run_load(
    job: LoadJob, load_backend: BackendLoader, spec: ModelSpec, options: ModelOptions
) -> None:
    """Load the model with the options the engine decoded (the backend does not decode again)."""
    try:
        backend = load_backend(spec, options)
        try:
            job.draft = load_draft(spec, options, load_backend, backend)
        except BaseException:
            backend.close()
            raise
        job.backend = backend
        # Asked once (and again after a deferred probe): a model mlx-lm cannot batch (kv_bits,
        # chunked caches) stays on B=1 for good.
        job.batchable = job.backend.open_batch() is not None
        job.probe = job.backend.deferred_probe()
    except BaseException as exc:
        job.error = exc


def run_tidy(job: TidyJob, backend: Backend) -> None:
    try:
        job.did = backend.tidy()
    except BaseException as exc:
        job.error = exc


def run_probe_step(job: ProbeJob, backend: Backend) -> None:
    """A piece of the deferred probe; after the last, whether the model batches now."""
    try:
        job.info = job.probe.step()
        if job.info is not None:
            job.batchable = backend.open_batch() is not None
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
            # The window plans for the request's own max_tokens (a prewarm passes the one its
            # generate will use), so both render the same tokens; admission checks it (and
            # lowers it to the room left, unless strict), naming the value the request sent.
            reply_room = seq.max_tokens or 1
            prepared = prepare_chat(
                backend.chat_tokenizer,
                backend.prepare_media(request.messages),
                request.chat,
                min(reply_room, backend.info.context_length - 1),
                backend.info.context_length,
                reply_may_shrink=True,
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
    """One restore or prefill chunk of ``seq``, unless its abort flag is set (a decode step is
    ``decode.run_decode``)."""
    if seq.abort.is_set():
        job.skipped = True
        return
    try:
        if seq.phase is Phase.RESTORING:
            job.state = _restore(job, seq, backend, restore_source)
        else:
            _prefill_chunk(job, seq, backend)
    except BaseException as exc:
        job.error = exc


def run_together(job: TogetherJob, backend: Backend) -> None:
    """Prefill the sequences not aborted meanwhile; a failure fails each of them."""
    live = []
    for step in job.steps:
        if step.seq.abort.is_set():
            step.skipped = True
        else:
            live.append(step)
    if not live:
        return
    states, rests, points = [], [], []
    for step in live:
        state, tokens = step.seq.state, step.seq.tokens
        assert state is not None
        assert tokens is not None
        states.append(state)
        rests.append(tokens[state.length :])
        points.append(list(step.seq.checkpoints))  # all within the prompt: it goes in whole
    try:
        taken = backend.prefill_together(states, rests, points)
        for step, rest, at, snapshots in zip(live, rests, points, taken, strict=True):
            step.prefilled = len(rest)
            _keep_snapshots(step, backend, at, snapshots)
    except BaseException as exc:
        for step in live:
            step.error = exc


def _restore(
    job: StepJob, seq: Sequence, backend: Backend, source: RestoreSource | None
) -> SequenceState:
    if seq.state is not None:  # adopted from a prewarm
        state = seq.state
    elif source is None:
        state = backend.new_state()
    else:
        try:
            cut = backend.take_state if source.taken else backend.copy_state
            # Taken: the entry left the cache, its state is ours to cut back.
            state = cut(source.state, seq.restore_length, source.snapshot, reach=seq.reach_length)
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
    # A chunk never ends inside an image's soft tokens: a family that attends both ways there
    # needs the run in one pass (runtime/backends/vision/bidirectional.py).
    end = min(past_span(seq.tokens, start + job.chunk_tokens), seq.prefill_target)
    if end < seq.prefill_target:
        # A chunk with checkpoints inside ends at its last one: the piece after that cut would be
        # a short pass of its own, and the next chunk would begin with another, where a pass
        # costs a read of every weight however few its rows (Gemma 3 on llama.cpp: 23 rows took
        # 50 ms, 489 took 810). Ending there, the next chunk takes that piece in its first pass.
        end = max((p for p in seq.checkpoints if start < p < end), default=end)
    points = [p for p in seq.checkpoints if p <= end]
    # Logits only once the whole prompt is in: a generate samples from them next.
    logits = end == len(seq.tokens) and seq.kind is RequestKind.GENERATE
    try:
        taken = backend.prefill(
            seq.state, seq.tokens[start:end], logits=logits, snapshot_at=points, stop=seq.abort
        )
    except PrefillInterrupted as stopped:
        # Aborted meanwhile: the state is as before the chunk, or at the last snapshot point it
        # passed, whose snapshots join the sequence's (an entry of that length is kept).
        job.skipped = True
        if stopped.kept:
            job.prefilled = stopped.kept
            _keep_snapshots(job, backend, points[: len(stopped.snapshots)], stopped.snapshots)
        return
    job.prefilled = end - start
    _keep_snapshots(job, backend, points, taken)


def _keep_snapshots(
    job: StepJob, backend: Backend, points: list[int], taken: Iterable[Snapshot]
) -> None:
    """Hand the snapshots a prefill took at ``points`` to ``job``: the session's instructions
    prefix as a whole state of its own, the rest as checkpoints."""
    seq = job.seq
    assert seq.state is not None
    job.passed = len(points)
    for point, snapshot in zip(points, taken, strict=True):
        if point == seq.pin_at:  # the instructions prefix: the whole state there, its own entry
            job.pin_copy = backend.copy_state(seq.state, point, snapshot)
        else:
            job.snapshots.append(snapshot)
