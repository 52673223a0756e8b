"""The router's live requests: each accepted request that has not ended, by request id and by
sequence id, and which of them have started (the host has heard ``Started``).

A request is live from its acceptance to its terminal, or until it is moved to another replica
(then it is live again under a new sequence id). The terminals the router makes itself for a live
request (its engine drained or gave up) are built here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.replica_costs import Queued
from runtime.kernel.core import Address
from runtime.messages import (
    EngineTerminal,
    Generate,
    Prewarm,
    SequenceCancelled,
    SequenceFailed,
    Usage,
)


@dataclass(frozen=True)
class Live:
    """One live request: who asked, and where it runs."""

    request_id: str
    incarnation: int
    host: Address
    model: str  # the load it runs on (a replica's NAME@i)
    epoch: int
    sequence_id: int
    request: Generate | Prewarm  # as the host sent it: a move to another replica sends it again
    accepted_at: float  # its timeout_s counts from here, across a move
    moved: bool = False  # it was moved to another replica once already


class LiveRequests:
    """Live requests by request id and by sequence id (see module docstring)."""

    def __init__(self) -> None:
        self._by_request: dict[str, Live] = {}
        self._by_sequence: dict[int, Live] = {}
        self._started: set[int] = set()
        # What routing estimates a replica's queue from (actors/replica_costs.py): each looked-up
        # request's uncached prompt tokens, and which requests are decoding (a token came).
        self._uncached: dict[int, int] = {}
        self._decoding: set[int] = set()

    def __len__(self) -> int:
        return len(self._by_request)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_request

    def of_request(self, request_id: str) -> Live | None:
        return self._by_request.get(request_id)

    def of_sequence(self, sequence_id: int) -> Live | None:
        return self._by_sequence.get(sequence_id)

    def of_epoch(self, epoch: int) -> list[Live]:
        """A copy: safe to end them while iterating."""
        return [live for live in self._by_sequence.values() if live.epoch == epoch]

    def is_live(self, sequence_id: int, epoch: int) -> bool:
        live = self._by_sequence.get(sequence_id)
        return live is not None and live.epoch == epoch

    def sequences(self) -> dict[int, tuple[str, int]]:
        """Sequence id → (request id, incarnation) of every live request."""
        return {s: (v.request_id, v.incarnation) for s, v in self._by_sequence.items()}

    def add(self, live: Live) -> None:
        self._by_request[live.request_id] = live
        self._by_sequence[live.sequence_id] = live

    def pop(self, sequence_id: int) -> Live:
        """Forget the live request of ``sequence_id`` (it must be live)."""
        live = self._by_sequence.pop(sequence_id)
        del self._by_request[live.request_id]
        self._started.discard(sequence_id)
        self._uncached.pop(sequence_id, None)
        self._decoding.discard(sequence_id)
        return live

    def started(self, sequence_id: int) -> None:
        self._started.add(sequence_id)

    def has_started(self, sequence_id: int) -> bool:
        return sequence_id in self._started

    def looked_up(self, sequence_id: int, uncached: int) -> None:
        """``sequence_id``'s replica must prefill ``uncached`` of its prompt's tokens."""
        if sequence_id in self._by_sequence:
            self._uncached[sequence_id] = uncached

    def decoding(self, sequence_id: int) -> None:
        """``sequence_id``'s first token came: it is past its prefill."""
        if sequence_id in self._by_sequence:
            self._decoding.add(sequence_id)

    def queued_on(self, model: str, besides: int | None = None) -> list[Queued]:
        """The live requests on load ``model`` (but ``besides``), as routing estimates them."""
        return [
            Queued(self._uncached.get(s), s in self._decoding)
            for s, live in self._by_sequence.items()
            if live.model == model and s != besides
        ]


def cancelled_by_unload(live: Live) -> EngineTerminal:
    """The terminal of a request its engine's drain left live (defensive: counted)."""
    return SequenceCancelled(
        sequence_id=live.sequence_id, epoch=live.epoch, usage=Usage(), reason="model_unloaded"
    )


def failed_with(live: Live, code: str, text: str, *, retry: bool = True) -> EngineTerminal:
    """``retry``: after a crash the model is reloading (or failed: then the retry says so)."""
    return SequenceFailed(
        sequence_id=live.sequence_id,
        epoch=live.epoch,
        code=code,
        message=text,
        retryable=retry,
        usage=Usage(),
    )
