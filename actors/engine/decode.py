"""Decode steps on the engine's compute thread: one sequence's (the B=1 fast path) and the batch's.

A step picks a sequence's next token as a *draw* (``runtime.text.sampling.Draw``): arrays not
computed yet. On a pipelined backend (MLX) it builds the step that feeds the drawn token before
reading it, as mlx-lm's ``generate_step`` does, so the device does not wait for the loop between
tokens. Only where every layer trims does it build ahead (an EOS fed ahead must be cut back out);
elsewhere, and under DRY, the token is fed at the next step (``Decoding.pending``). A sequence's
prefix entry is keyed by what its cache holds (``Decoding.history``).

See docs/design.md, "The decode path".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from actors.engine.jobs import BatchJob, StepJob
from actors.engine.sequence import Decoding, Sequence
from actors.engine.speculate import draft_room, speculate
from runtime.backends.contract import Backend, DecodeBatchHandle, ReuseStrategy
from runtime.errors import ConstraintDeadEnd, ConstraintsUnsupported
from runtime.messages import Constraint, TokenLogprob

if TYPE_CHECKING:
    import mlx.core as mx

    from runtime.text.constraints import TokenMatcher
    from runtime.text.sampling import Draw, SampleResult, TokenSampler


def run_decode(job: StepJob, seq: Sequence, backend: Backend) -> None:
    """One token of ``seq`` alone, unless its abort flag is set: compute the draw the last step
    left (or feed the last token read and draw), build the next step on it, read it."""
    if seq.abort.is_set():
        job.skipped = True
        return
    decoding = seq.decoding if job.first is None else job.first
    assert decoding is not None
    if job.first is not None:
        assert seq.state is not None
        if seq.state.length < seq.prefill_target:
            return  # the chunk it was queued behind did not finish the prompt (failed, stopped)
    elif job.queued and (decoding.ended or (decoding.ahead is None and decoding.pending is None)):
        return  # the step it was queued behind ended the sequence (or failed)
    try:
        _decode(job, seq, decoding, backend)
    except BaseException as exc:
        job.error = exc
        decoding.ended = True  # a step queued behind this one must not go on


def _decode(job: StepJob, seq: Sequence, decoding: Decoding, backend: Backend) -> None:
    assert seq.state is not None
    speculation = decoding.speculation
    if speculation is not None and decoding.ahead is None and decoding.pending is not None:
        drafts = speculation.drafts(decoding.history, draft_room(seq, decoding))
        matcher = None if decoding.sampler is None else decoding.sampler.matcher
        if drafts and matcher is not None:  # drafts the grammar forbids are never verified
            del drafts[matcher.valid_prefix(drafts) :]
        if drafts:
            speculate(job, seq, decoding, backend, drafts, read, _sampler)
            return
    if speculation is not None:
        speculation.decoded_plainly()
    draw, decoding.ahead = decoding.ahead, None
    if draw is None:
        if decoding.pending is not None:
            backend.prefill(seq.state, [decoding.pending])
            job.prefilled = 1
        logits = backend.logits(seq.state)
        sampler = _sampler(decoding, seq, backend, logits)
        draw = sampler.draw(logits, decoding.history, seq.rng, computed=not backend.pipelined)
    draw.start()
    if job.build_ahead and _may_build_next(seq, decoding, backend):
        try:
            logits = backend.feed(seq.state, draw.token)
            job.prefilled += 1
            job.fed = True
            sampler = _sampler(decoding, seq, backend, logits)
            decoding.ahead = sampler.draw(logits, decoding.history, seq.rng, fed=draw.token)
        except BaseException as exc:
            job.ahead_error = exc
    read(job, seq, decoding, draw.read())
    if job.ahead_error is not None:
        decoding.ended = True
    elif job.prefilled and not backend.pipelined:  # a sequence's first token is shown at once
        _decode_more(job, seq, decoding, backend)


def _decode_more(job: StepJob, seq: Sequence, decoding: Decoding, backend: Backend) -> None:
    """Up to ``Backend.decode_block`` tokens in this step (module docstring): each fed and read
    as a step of its own, into ``job.more``, until one ends the sequence or fails, the abort
    flag is set, or the loop asks the slot back (``job.yield_to``)."""
    assert seq.state is not None
    room = backend.decode_block - 1 if job.build_ahead and not seq.stop_strings else 0
    record = job
    while room > 0 and not decoding.ended and record.error is None and not seq.abort.is_set():
        if job.yield_to is not None and job.yield_to.is_set():
            return
        assert decoding.pending is not None
        assert decoding.sampler is not None
        record = StepJob(seq)
        job.more.append(record)
        try:
            backend.prefill(seq.state, [decoding.pending])
            job.prefilled += 1
            logits = backend.logits(seq.state)
            draw = decoding.sampler.draw(logits, decoding.history, seq.rng, computed=True)
            draw.start()
            sampled = draw.read()
        except BaseException as exc:  # the tokens before it are still shown (outcomes.py)
            record.error = exc
            decoding.ended = True
            return
        read(record, seq, decoding, sampled)
        room -= 1


def run_batch(job: BatchJob, backend: Backend, batch: DecodeBatchHandle | None) -> None:
    """Leave, join, then one forward pass for every member; a member aborted meanwhile leaves.

    A member with a draw left by the last step is fed it unread, reads it once the pass is built,
    and leaves the draw from this pass to the next step; one with a token read and not fed (a
    sampler that reads every token first, or a backend that is not pipelined) is fed that token
    and draws and reads from this pass at once.
    """
    try:
        if batch is None:
            batch = backend.open_batch()
            if batch is None:
                raise RuntimeError("this model's caches cannot be batched")
        job.batch = batch
        work = job.work
        for seq in (*work.members, *work.joiners):
            if seq.decoding is not None and seq.decoding.ahead is not None:
                seq.decoding.ahead.start()  # computed first: the last pass's tokens are read below
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
        if slots:
            _step_batch(job, backend, batch, slots)
    except BaseException as exc:
        job.error = exc
        return
    _batch_more(job, backend, batch, slots)


def _step_batch(
    job: BatchJob, backend: Backend, batch: DecodeBatchHandle, slots: dict[int, Sequence]
) -> None:
    fed: dict[int, int | mx.array] = {}
    for slot, seq in slots.items():
        decoding = seq.decoding
        assert decoding is not None
        token = decoding.pending if decoding.ahead is None else decoding.ahead.token
        assert token is not None  # only sequences with a token to feed join (batch.py)
        fed[slot] = token
    logits = batch.step(fed, _argmax_slots(slots, backend))
    reads: dict[int, Draw] = {}
    for slot, seq in slots.items():
        decoding = seq.decoding
        assert decoding is not None
        step = StepJob(seq, prefilled=1)
        row = logits[slot]
        if isinstance(row, int):  # asked of a plain greedy sampler with no draw ahead
            reads[slot] = _picked(row)
            job.stepped[seq.sequence_id] = step
            continue
        sampler = _sampler(decoding, seq, backend, row)
        draw, decoding.ahead = decoding.ahead, None
        if draw is None:
            draw = sampler.draw(row, decoding.history, seq.rng, computed=not backend.pipelined)
        else:
            step.fed = True
            if _may_build_next(seq, decoding, backend):
                decoding.ahead = sampler.draw(row, decoding.history, seq.rng, fed=draw.token)
        reads[slot] = draw
        job.stepped[seq.sequence_id] = step
    for slot, seq in slots.items():
        assert seq.decoding is not None
        read(job.stepped[seq.sequence_id], seq, seq.decoding, reads[slot].read())


def _batch_more(
    job: BatchJob, backend: Backend, batch: DecodeBatchHandle, slots: dict[int, Sequence]
) -> None:
    """Up to ``Backend.decode_block`` steps of the batch in this job, as ``_decode_more`` does
    for a lone stream: each member's tokens after the first go to its step's ``more``. Only
    while every member goes on (none ended, failed, aborted or with stop strings) and the loop
    does not want the slot back; a failing step fails each member after its tokens so far."""
    if backend.pipelined or not slots:
        return
    for _ in range(backend.decode_block - 1):
        if job.yield_to is not None and job.yield_to.is_set():
            return
        records = {slot: job.stepped[seq.sequence_id] for slot, seq in slots.items()}
        fed: dict[int, int | mx.array] = {}
        for slot, seq in slots.items():
            decoding, last = seq.decoding, records[slot]
            last = last.more[-1] if last.more else last
            if (
                decoding is None
                or decoding.ended
                or decoding.pending is None
                or decoding.sampler is None
                or last.error is not None
                or seq.abort.is_set()
                or seq.stop_strings
            ):
                return
            fed[slot] = decoding.pending
        try:
            logits = batch.step(fed, _argmax_slots(slots, backend))
        except BaseException as exc:  # each member's tokens before it are still shown
            for slot, seq in slots.items():
                records[slot].more.append(StepJob(seq, error=exc))
                assert seq.decoding is not None
                seq.decoding.ended = True
            return
        for slot, seq in slots.items():
            decoding = seq.decoding
            assert decoding is not None
            assert decoding.sampler is not None
            record = StepJob(seq)
            records[slot].more.append(record)
            records[slot].prefilled += 1
            row = logits[slot]
            draw = (
                _picked(row)
                if isinstance(row, int)
                else decoding.sampler.draw(row, decoding.history, seq.rng, computed=True)
            )
            read(record, seq, decoding, draw.read())


def _argmax_slots(slots: dict[int, Sequence], backend: Backend) -> set[int]:
    """The members whose next token is their logits' argmax as they come, where the backend
    computes before it returns (llama.cpp then reads it off its own buffer, no copy): a plain
    greedy sampler (``TokenSampler.plain_argmax``) with no draw left by the last step."""
    if backend.pipelined:
        return set()
    return {
        slot
        for slot, seq in slots.items()
        if seq.decoding is not None
        and seq.decoding.ahead is None
        and seq.decoding.sampler is not None
        and seq.decoding.sampler.plain_argmax
    }


def _picked(token: int) -> Draw:
    from runtime.text.sampling import Draw

    return Draw(token)


def _may_build_next(seq: Sequence, decoding: Decoding, backend: Backend) -> bool:
    """Whether the step after the token being read may be built before it is read (not where
    the text is a copy so far: the step after it should verify drafts, which needs it read)."""
    assert decoding.sampler is not None
    speculation = None if seq.batch_slot is not None else decoding.speculation
    if speculation is not None and speculation.expects_drafts(
        decoding.history, draft_room(seq, decoding)
    ):
        return False
    return (
        backend.pipelined
        and backend.info.reuse is ReuseStrategy.TRIM  # a token fed ahead can be cut back out
        and decoding.read + 1 < seq.max_tokens  # the token being read is not the last allowed
        and not decoding.sampler.needs_read_history
        and not seq.abort.is_set()
    )


def read(job: StepJob, seq: Sequence, decoding: Decoding, sampled: SampleResult) -> None:
    """Take a read token: into the history, its text (and logprob when asked) into ``job``."""
    token = job.token = sampled.token
    decoding.history.append(token)
    decoding.read += 1
    decoding.pending = None if job.fed else token
    matcher = None if decoding.sampler is None else decoding.sampler.matcher
    if matcher is not None:  # an EOS too: llguidance allows one only where the grammar may end
        try:
            job.completes_constraint = matcher.accept(token)
        except ConstraintDeadEnd as exc:  # this row fails; a batch's other rows go on
            job.error = exc
            decoding.ended = True
            return
    if seq.sampling.logprobs:
        job.logprob = TokenLogprob(
            token=token, logprob=sampled.logprob or 0.0, top=sampled.top_logprobs
        )
    ending = token in seq.stop_token_ids
    last = decoding.read >= seq.max_tokens or job.completes_constraint
    decoding.ended = ending or last
    if not ending:
        job.text = decoding.detokenizer.add(token)
    if ending or last:
        job.text += decoding.detokenizer.flush()  # the stream ends: release any held-back bytes


def _sampler(decoding: Decoding, seq: Sequence, backend: Backend, logits: mx.array) -> TokenSampler:
    """``seq``'s sampler, built at its first draw."""
    if decoding.sampler is None:
        # Imported at the first sample, not with the engine: it imports mlx-lm (and transformers),
        # which loading a simulated model does not need.
        from runtime.text.sampling import TokenSampler

        vocab = int(logits.shape[0])
        matcher = _matcher(seq.sampling.constraint, backend)
        decoding.sampler = TokenSampler(seq.sampling, vocab, _token_decoder(backend), matcher)
    return decoding.sampler


def _matcher(constraint: Constraint | None, backend: Backend) -> TokenMatcher | None:
    """The grammar state of a constrained sequence (released by the engine when it ends)."""
    if constraint is None:
        return None
    engine = backend.constraint_engine()
    if engine is None:
        raise ConstraintsUnsupported(
            "this model's backend cannot constrain output (the simulated backend has no "
            "vocabulary a grammar engine can read); drop the constraint or use an MLX model"
        )
    return engine.matcher(constraint)


def _token_decoder(backend: Backend) -> Callable[[int], str]:
    """One stable callable per backend, so the sampler's sequence-breaker cache is shared."""
    cached: Callable[[int], str] | None = getattr(backend, "_token_decoder", None)
    if cached is None:

        def cached(token: int) -> str:
            return backend.decode([token])

        setattr(backend, "_token_decoder", cached)  # noqa: B010
    return cached
