"""The KV budget keeper's protocol: who holds budget (``Holder``), reserving, releasing and
transferring bytes, the keeper's own deadline timers, and releasing a whole model epoch.
"""

from __future__ import annotations

import enum

import msgspec

from runtime.messages.prefix_cache import Lookup
from runtime.messages.vocabulary import Message


class HolderKind(enum.StrEnum):
    SEQUENCE = "sequence"
    PREFIX_ENTRY = "prefix_entry"
    BATCH_PADDING = "batch_padding"  # an engine's decode batch: the left padding of its rows


class Holder(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who holds a reservation: a sequence, a prefix entry or a decode batch's padding, of one
    model epoch. Never reused (a batch's id is new for every batch the engine opens)."""

    model: str
    epoch: int
    kind: HolderKind
    id: int


class Reserve(Message, frozen=True):
    """Ask for ``nbytes`` of KV budget; answered ``Reserved`` or ``ReservationRefused``.

    Larger than the whole budget: refused at once. Otherwise granted, or queued FIFO (after asking
    the prefix manager to evict) until ``timeout_s``, then refused as retryable.
    ``then_lookup``: once granted (never if refused or dropped), the keeper sends this lookup to
    the prefix manager right after ``Reserved``, answered to the requester: a sequence's lookup
    follows its grant without a round trip back to the engine (one crossing saved each way for
    an engine in another process).
    """

    holder: Holder
    nbytes: int
    timeout_s: float | None = None
    then_lookup: Lookup | None = None


class Reserved(Message, frozen=True):
    holder: Holder
    nbytes: int


class ReservationRefused(Message, frozen=True):
    holder: Holder
    nbytes: int
    code: str
    message: str
    retryable: bool


class Release(Message, frozen=True):
    """Return ``holder``'s bytes: all of them (``nbytes`` None), or ``nbytes`` of them.

    A full release forgets the holder (a no-op for an unknown one: releases are idempotent). A
    partial one gives back what a holder no longer needs and keeps it; more than it holds frees
    what it holds.
    """

    holder: Holder
    nbytes: int | None = None


class Transfer(Message, frozen=True):
    """Move ``nbytes`` of ``source``'s reservation to ``target``, which becomes or joins a holder.

    Never grows the total; a source holding less moves what it has.
    """

    source: Holder
    target: Holder
    nbytes: int


class ReservationExpired(Message, frozen=True):
    """Keeper → itself (timer): the queued reservation of ``holder`` reached its deadline."""

    holder: Holder
    ticket: int


class ReservationPressure(Message, frozen=True):
    """Keeper → itself (timer, half-way to the deadline): if still queued, evict pinned too."""

    holder: Holder
    ticket: int


class ReleaseEpoch(Message, frozen=True):
    """Return every reservation of ``model`` at ``epoch`` (teardown's last word on memory).

    Answered with ``EpochReleased``. Later reservations for that epoch or older are dropped.
    """

    model: str
    epoch: int


class EnginePlaced(Message, frozen=True):
    """Engine's proxy → keeper: the engine of ``model`` at ``epoch`` runs on Ray node ``node``
    (IP address ``node_ip``); its reservations are made against that node's budget.

    Sent before any of the engine's own mail is handed on. A model epoch never announced is on
    the host (the host's budget). ``ReleaseEpoch`` forgets the placement with the bytes.
    """

    model: str
    epoch: int
    node: str
    node_ip: str = ""


class EpochReleased(Message, frozen=True):
    """Reply to ``ReleaseEpoch``: nothing of that epoch holds budget any more."""

    model: str
    epoch: int
