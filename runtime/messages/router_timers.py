"""The timers the router sends itself: a request's deadline, a stream's stall check, and a
model's keep-alive (``IdleCheck``). Each is stale, dropped and counted, once what it was armed for
has ended.
"""

from __future__ import annotations

from runtime.messages.vocabulary import Message


class RequestDeadline(Message, frozen=True):
    """Router → itself (timer): the request of sequence ``sequence_id`` reached its ``timeout_s``.

    Stale (counted, never acted on) if the request has ended.
    """

    sequence_id: int


class StallCheck(Message, frozen=True):
    """Router → itself (timer): has the stream of sequence ``sequence_id`` produced a token within
    its stall timeout? Stale (counted, never acted on) if the request has ended."""

    sequence_id: int


class IdleCheck(Message, frozen=True):
    """Router → itself (timer): ``model`` at ``epoch`` went idle (its ``idle_ticket``-th idle
    spell) a keep-alive ago. Acted on (the model is unloaded) only if the model is still that
    epoch, ready, with no request live and still in that same idle spell; otherwise stale:
    dropped and counted (a request came, or the model was unloaded or reloaded meanwhile)."""

    model: str
    epoch: int
    idle_ticket: int
