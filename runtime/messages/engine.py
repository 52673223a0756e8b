"""The router ↔ engine protocol: the router admits, aborts and drains sequences; the engine
reports its model's load and each sequence's events (the host's request events less the request's
identity, which the router adds: each event's ``for_request`` builds the host event). Also the
messages the engine sends itself (``ComputeDone``, ``ComputeWatch``, ``TidyDue``).
"""

from __future__ import annotations

from runtime.messages.host import (
    Cancelled,
    Failed,
    Finished,
    Generate,
    Prewarm,
    Started,
    TokensEmitted,
)
from runtime.messages.vocabulary import (
    FinishReason,
    Message,
    PromptFacts,
    ReusePath,
    ReuseTier,
    TokenIds,
    TokenLogprob,
    Usage,
)

# --------------------------------------------------------------------------- router ↔ engine


class Admit(Message, frozen=True):
    """Router → engine: run a new sequence for ``request``, the ``Generate`` or ``Prewarm`` as the
    host sent it.

    Beside it only what the router decided: the ``sequence_id`` (never reused), the engine's
    ``epoch``, and the resolved ``session`` (the request's own, else ``"{model}/{namespace}"``).
    ``tokens`` / ``facts``: a request moved from another replica of the model comes with its
    prompt as that replica tokenized (and rendered) it; the engine does not tokenize it again.
    """

    sequence_id: int
    epoch: int
    session: str
    request: Generate | Prewarm
    tokens: TokenIds | None = None
    facts: PromptFacts | None = None


class Abort(Message, frozen=True):
    """Router → engine: stop sequence ``sequence_id`` of ``epoch`` at its next boundary."""

    sequence_id: int
    epoch: int
    reason: str = "cancelled"


class Drain(Message, frozen=True):
    """Router → engine: abort everything, stop compute, free all memory, then reply ``Drained``."""

    epoch: int


class EngineReady(Message, frozen=True):
    """Engine → router: the model of ``epoch`` is loaded and warm."""

    epoch: int
    reuse_path: str
    bytes_per_token: int
    context_length: int
    chat_template: bool = True
    # Capabilities the load probe switched off for this model, each with why (backend docs).
    limits: dict[str, str] = {}  # noqa: RUF012 (a msgspec default; ruff cannot see the base here)
    # The probe runs in the background: every probed capability is off until ``EngineProbed``.
    probe_pending: bool = False
    # Where the engine runs when not in the host's process: "node NODE pid PID" (a Ray actor).
    placement: str = ""


class EngineProbed(Message, frozen=True):
    """Engine → router: the model's deferred load probe gave its verdict (after ``EngineReady``,
    which said every probed capability was off until then): its reuse path and limits now."""

    epoch: int
    reuse_path: str
    limits: dict[str, str] = {}  # noqa: RUF012 (a msgspec default; ruff cannot see the base here)


class EngineLoadFailed(Message, frozen=True):
    """Engine → router: the model could not be loaded."""

    epoch: int
    code: str
    message: str


class EngineFailed(Message, frozen=True):
    """Engine → router: the engine of ``epoch`` crashed (a bug in its handler, or a compute step
    that overran ``RuntimeConfig.step_timeout_s``). Every sequence of it has ended and every byte of
    its epoch is back in the budget; the router reloads the model at a new epoch, or, beyond the
    restart intensity, marks it failed."""

    epoch: int
    code: str
    message: str


class SequenceStarted(Message, frozen=True):
    """Engine → router: the host's ``Started`` for sequence ``sequence_id`` (``for_request``)."""

    sequence_id: int
    epoch: int
    prompt_tokens: int
    cached_tokens: int
    path: ReusePath
    dropped_turns: int = 0
    reasoning_open: bool = False
    tier: ReuseTier = ReuseTier.COLD  # where the reused state came from
    taken: bool = False  # the reused entry was taken in place, not copied (``Started.taken``)

    def for_request(self, request_id: str, incarnation: int) -> Started:
        """The host's event, built field by field (tests/test_engine_events.py checks them all)."""
        return Started(
            request_id=request_id,
            incarnation=incarnation,
            sequence_id=self.sequence_id,
            epoch=self.epoch,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            path=self.path,
            dropped_turns=self.dropped_turns,
            reasoning_open=self.reasoning_open,
            tier=self.tier,
            taken=self.taken,
        )


class TokensProduced(Message, frozen=True):
    """Engine → router: the host's ``TokensEmitted`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    token_ids: TokenIds
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()

    def for_request(self, request_id: str, incarnation: int) -> TokensEmitted:
        """The host's event: the per-token path, so built directly, no reflection."""
        return TokensEmitted(
            request_id=request_id,
            incarnation=incarnation,
            token_ids=self.token_ids,
            text=self.text,
            logprobs=self.logprobs,
        )


class SequenceFinished(Message, frozen=True):
    """Engine → router: the host's ``Finished`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    reason: FinishReason
    usage: Usage
    stop: str | None = None

    def for_request(self, request_id: str, incarnation: int) -> Finished:
        """The host's terminal event."""
        return Finished(
            request_id=request_id,
            incarnation=incarnation,
            reason=self.reason,
            usage=self.usage,
            stop=self.stop,
        )


class SequenceCancelled(Message, frozen=True):
    """Engine → router: the host's ``Cancelled`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    usage: Usage
    reason: str = "cancelled"

    def for_request(self, request_id: str, incarnation: int) -> Cancelled:
        """The host's terminal event."""
        return Cancelled(
            request_id=request_id, incarnation=incarnation, usage=self.usage, reason=self.reason
        )


class SequenceFailed(Message, frozen=True):
    """Engine → router: the host's ``Failed`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    code: str
    message: str
    retryable: bool
    usage: Usage

    def for_request(self, request_id: str, incarnation: int) -> Failed:
        """The host's terminal event."""
        return Failed(
            request_id=request_id,
            incarnation=incarnation,
            code=self.code,
            message=self.message,
            retryable=self.retryable,
            usage=self.usage,
        )


class Drained(Message, frozen=True):
    """Engine → router: nothing of ``epoch`` runs or holds memory any more."""

    epoch: int


# --------------------------------------------------------------------------- engine internal


class ComputeDone(Message, frozen=True):
    """Engine → itself: the compute job ``job_id`` finished (its result stays in the engine)."""

    job_id: int


class DiskDone(Message, frozen=True):
    """Engine → itself: the disk-tier job ``job_id`` (a scan, write or read on its I/O thread)
    finished; its result stays in the engine (actors/engine/disk_tier.py)."""

    job_id: int


class ComputeWatch(Message, frozen=True):
    """Engine → itself (timer): has the compute step in flight overrun ``step_timeout_s``?"""


class TidyDue(Message, frozen=True):
    """Engine → itself (timer): the compute slot has been idle since idle period ``idle_period``
    began; if no work came since, the backend may tidy (``Backend.tidy``)."""

    idle_period: int
