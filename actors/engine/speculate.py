"""A speculative decode step of one sequence (the B=1 fast path), on the compute thread.

The pending token and the drafts after it (drafting.py) run through the model in one pass
(``Backend.verify``). Each position's pick (``TokenSampler.judge``) is read as a plain step reads
its token (decode.py). The block ends at the first pick that differs from its draft, after the last
draft (a bonus pick), or at a token that ends the sequence. The cache keeps the pending token and
the accepted drafts (``Backend.rewind``); the block's last pick is the new pending token, so the
history again holds exactly the cache's tokens and the pending one.

See docs/design.md, "Speculative decoding (prompt lookup)".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.engine.jobs import StepJob
from actors.engine.sequence import Decoding, Sequence
from runtime.backends.contract import Backend

if TYPE_CHECKING:
    from collections.abc import Callable

    import mlx.core as mx

    from runtime.text.sampling import SampleResult, TokenSampler

    Read = Callable[[StepJob, Sequence, Decoding, SampleResult], None]
    Sampler = Callable[[Decoding, Sequence, Backend, mx.array], TokenSampler]


def draft_room(seq: Sequence, decoding: Decoding) -> int:
    """The most drafts a pass may verify: every token of its block must fit in ``max_tokens``
    (so the cache never holds more than the prompt and ``max_tokens``, as priced)."""
    return max(0, seq.max_tokens - decoding.read - 1)


def speculate(
    job: StepJob,
    seq: Sequence,
    decoding: Decoding,
    backend: Backend,
    drafts: list[int],
    read: Read,
    sampler_of: Sampler,
) -> None:
    """Verify ``drafts`` after the pending token; the block's tokens go to ``job`` (its first)
    and ``job.more`` (the rest), as if each had been a step of its own."""
    assert seq.state is not None
    assert decoding.pending is not None
    speculation = decoding.speculation
    assert speculation is not None
    fed = [decoding.pending, *drafts]
    logits = backend.verify(seq.state, fed)
    sampler = sampler_of(decoding, seq, backend, logits[0])
    picks = accepted = 0
    record = job
    for i in range(len(fed)):
        row = logits[i]
        if i:
            record = StepJob(seq, prefilled=0)
            job.more.append(record)
        if i < len(drafts):
            sampled = sampler.judge(row, decoding.history, seq.rng, drafts[i])
        else:  # past the last draft: a token of the pass's own
            sampled = sampler.draw(row, decoding.history, seq.rng).read()
        read(record, seq, decoding, sampled)
        picks += 1
        hit = i < len(drafts) and sampled.token == drafts[i]
        accepted += hit
        if record.error is not None or decoding.ended or not hit:
            break
    # The cache keeps the pending token and the block's tokens before its last (fed next step).
    backend.rewind(seq.state, picks)
    job.prefilled = picks
    job.drafted = len(drafts)
    job.accepted = accepted
    speculation.passed(len(drafts), accepted)
