"""What the router hears of a sequence: its start, its tokens and text, and its one terminal event.

A decode step's token is taken here: an EOS or stop token ends the sequence unseen, a completed
stop string ends it with the text before the string, ``max_tokens`` ends it after the token; any
other token is shown with its text. ``take_token`` decides and returns an ``Emission``; the step's
outcome (outcomes.py) sends it (``emit``) and has ``Endings`` carry out the ending it names: no
ending happens here, only the terminal events are built here (``finished``, ``cancelled``,
``failed``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from actors.engine.draft_model import DraftModel, DraftSource
from actors.engine.drafting import Speculation
from actors.engine.sequence import Decoding, Phase, Sequence
from runtime.kernel.core import ROUTER, Context
from runtime.kernel.stats import Counters
from runtime.messages import (
    FinishReason,
    ReusePath,
    ReuseTier,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    TokenIds,
    TokenLogprob,
    TokensProduced,
)
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.stop_strings import StopStringMatcher

log = logging.getLogger("mlx_actor_runtime.engine")


@dataclass(frozen=True)
class Emission:
    """What one decode step shows the client, and the ending it brings (``finish`` None: none)."""

    token_ids: TokenIds
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish: FinishReason | None = None
    stop: str | None = None  # the stop string that ended it


def announce_start(seq: Sequence, counters: Counters, ctx: Context) -> None:
    """Tell the router how the prompt state was obtained, once that is final (after restore)."""
    assert seq.tokens is not None
    assert seq.state is not None
    if seq.started_sent:
        return
    seq.started_sent = True
    if seq.path is ReusePath.ADOPTED:
        seq.cached_tokens = seq.state.length  # what the prewarm had computed when it ended
    counters.inc(f"path_{seq.path}")
    if seq.path is ReusePath.MISS:
        tier = ReuseTier.COLD
    else:
        tier = ReuseTier.DISK if seq.from_disk else ReuseTier.RAM
    counters.inc(f"tier_{tier}")
    log.debug("sequence %d: %s, %d of %d prompt tokens reused", seq.sequence_id, seq.path,
              seq.cached_tokens, len(seq.tokens))  # fmt: skip
    counters.inc("cached_prompt_tokens", seq.cached_tokens)
    ctx.send(
        ROUTER,
        SequenceStarted(
            sequence_id=seq.sequence_id,
            epoch=seq.epoch,
            prompt_tokens=len(seq.tokens),
            cached_tokens=seq.cached_tokens,
            path=seq.path,
            dropped_turns=seq.dropped_turns,
            reasoning_open=seq.reasoning_open,
            tier=tier,
            taken=seq.taken,
        ),
    )


def start_decoding(
    seq: Sequence, decode: Callable[[Tokens[int]], str], draft: DraftModel | None = None
) -> None:
    """The prompt is in: from now on each step samples a token (its text built on the compute
    thread, ``Decoding``) and the text is matched against the stop strings here. A speculating
    sequence drafts with ``draft`` (the model's draft model) where there is one."""
    seq.move(Phase.DECODING)
    seq.decoding = seq.next_decoding or fresh_decoding(seq, decode)
    seq.next_decoding = None
    if seq.drafts:
        source = None if draft is None else DraftSource(draft)
        seq.decoding.speculation = Speculation(seq.drafts, source=source)
    if seq.stop_strings:
        seq.stop_matcher = StopStringMatcher(seq.stop_strings)


def fresh_decoding(seq: Sequence, decode: Callable[[Tokens[int]], str]) -> Decoding:
    """The compute thread's side of ``seq``'s decoding before its first draw."""
    assert seq.tokens is not None
    return Decoding(history=list(seq.tokens), detokenizer=IncrementalDetokenizer(decode))


def take_token(
    seq: Sequence, token: int, text: str, logprob: TokenLogprob | None, completes: bool = False
) -> Emission:
    """Record the token a decode step sampled (``text``: its detokenized text) and say what the
    client sees of it and whether it ends the sequence (``completes``: it completed the request's
    constraint, which allows nothing after it: a stop, as an EOS would be)."""
    matcher = seq.stop_matcher
    if token in seq.stop_token_ids:  # EOS or a stop token: not emitted, not counted
        tail, stop = text, None
        if matcher is not None:  # the last text may itself complete a stop string
            ended = matcher.feed(text)
            tail = ended.text if ended.stopped else ended.text + matcher.flush()
            stop = ended.stop
        return Emission((), tail, finish=FinishReason.STOP, stop=stop)
    seq.generated.append(token)
    result = matcher.feed(text) if matcher else None
    logprobs = () if logprob is None else (logprob,)
    if result is not None and result.stopped:
        return Emission((token,), result.text, logprobs, FinishReason.STOP, result.stop)
    shown = text if result is None else result.text
    last = len(seq.generated) >= seq.max_tokens
    if (last or completes) and matcher is not None:
        shown += matcher.flush()
    finish = FinishReason.STOP if completes else FinishReason.LENGTH if last else None
    return Emission((token,), shown, logprobs, finish)


def emit_block(seq: Sequence, emissions: list[Emission], ctx: Context) -> None:
    """Send what one job's tokens show (a decode block's, a speculative block's) as one
    ``TokensProduced``: the router and the host handle a message per block, not per token
    (the loop's work per token is taken from the model's threads on a CPU they fill). With
    logprobs, one message per token: the HTTP layer pairs each token's text with its logprob."""
    if len(emissions) == 1 or any(e.logprobs for e in emissions):
        for each in emissions:
            emit(seq, each, ctx)
        return
    token_ids = tuple(t for e in emissions for t in e.token_ids)
    emit(seq, Emission(token_ids, "".join(e.text for e in emissions)), ctx)


def emit(seq: Sequence, emission: Emission, ctx: Context) -> None:
    """Send the tokens and text of ``emission`` to the router, unless there are none."""
    if not emission.token_ids and not emission.text:
        return
    produced = TokensProduced(
        sequence_id=seq.sequence_id,
        epoch=seq.epoch,
        token_ids=emission.token_ids,
        text=emission.text,
        logprobs=emission.logprobs,
    )
    ctx.send(ROUTER, produced)


def finished(seq: Sequence, reason: FinishReason, stop: str | None = None) -> SequenceFinished:
    return SequenceFinished(
        sequence_id=seq.sequence_id, epoch=seq.epoch, reason=reason, usage=seq.usage(), stop=stop
    )


def cancelled(seq: Sequence) -> SequenceCancelled:
    return SequenceCancelled(
        sequence_id=seq.sequence_id, epoch=seq.epoch, usage=seq.usage(), reason=seq.abort_reason
    )


def failed(seq: Sequence, code: str, text: str, retryable: bool) -> SequenceFailed:
    return SequenceFailed(
        sequence_id=seq.sequence_id,
        epoch=seq.epoch,
        code=code,
        message=text,
        retryable=retryable,
        usage=seq.usage(),
    )
