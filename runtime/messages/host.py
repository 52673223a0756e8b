"""The host's protocol with the router: what the host sends (requests ``Generate`` / ``Prewarm``,
``Cancel`` and the commands) and what it hears back (a request's events ``Started``,
``TokensEmitted`` and one terminal event, or ``Rejected``; each command's reply).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from runtime.messages.request import Request
from runtime.messages.vocabulary import (
    FinishReason,
    Message,
    ModelSpec,
    ReusePath,
    ReuseTier,
    TokenIds,
    TokenLogprob,
    Usage,
)

# --------------------------------------------------------------------------- host → router


class Generate(Message, frozen=True):
    """Start generating ``request``, carried as the edge built it (runtime/messages/request.py).

    ``incarnation`` is unique per runtime: a recycled ``request_id`` is safe.
    """

    request_id: str
    incarnation: int
    request: Request


class Prewarm(Message, frozen=True):
    """Prefill ``request``'s prompt and commit its state to the prefix cache, without sampling.

    ``timeout_s``: it ends ``Failed(request_timeout)`` that long after the router accepted it.
    A prewarm supersedes its session's older prewarms, or adopts one it extends; identical
    concurrent prewarms (same tokens and namespace, any session) compute once. ``session``,
    ``anonymous`` and ``keep_on_disk`` as ``Request`` says; its generate-only fields stay at
    their defaults.
    """

    request_id: str
    incarnation: int
    request: Request


class Cancel(Message, frozen=True):
    """Cancel the request ``(request_id, incarnation)``; a no-op if it is not live."""

    request_id: str
    incarnation: int


class LoadModel(Message, frozen=True):
    """Load a model under ``spec.name``; replied to with ``ModelLoaded`` or ``CommandFailed``."""

    spec: ModelSpec


class UnloadModel(Message, frozen=True):
    """Drain and unload a model; replied to with ``ModelUnloaded`` once its memory is free."""

    model: str


class ResetPrefixes(Message, frozen=True):
    """Drop cached prefixes of ``model`` (``namespace`` None: every namespace)."""

    model: str
    namespace: str | None = None


class EndSession(Message, frozen=True):
    """The host is done with ``session``: its pinned instructions prefix may be evicted again.

    Router → engine; answered ``SessionEnded``.
    """

    model: str
    session: str
    namespace: str = "default"


class SessionEnded(Message, frozen=True):
    """Reply to ``EndSession``; ``unpinned`` says whether the session had a pinned prefix."""

    model: str
    session: str
    unpinned: bool


class GetStats(Message, frozen=True):
    """Ask an actor for its counters; replied to with ``Stats``."""


class ListModels(Message, frozen=True):
    """Host → router: every model it knows and its state; replied to with ``ModelsListed``."""


class Shutdown(Message, frozen=True):
    """Unload every model and stop; replied to with ``ShutdownComplete``."""


# --------------------------------------------------------------------------- router → host


class Started(Message, frozen=True):
    """The request has its prompt state and starts producing tokens (a prewarm: committing)."""

    request_id: str
    incarnation: int
    sequence_id: int
    epoch: int
    prompt_tokens: int
    cached_tokens: int
    path: ReusePath
    dropped_turns: int = 0  # chat history turns the window left out (only when asked for)
    # The rendered chat prompt ends inside an open reasoning block (``<think>``): the output
    # starts as reasoning (runtime/text/reasoning.py).
    reasoning_open: bool = False
    tier: ReuseTier = ReuseTier.COLD  # where the reused state came from
    # The reused entry was taken: it left the prefix cache and its state was cut back in place
    # instead of copied (docs/reuse.md, "Taking an entry instead of copying it").
    taken: bool = False


class TokensEmitted(Message, frozen=True):
    """New tokens (with their text, UTF-8 complete) for a generate request.

    ``logprobs`` has one entry per token when the request asked for them.
    """

    request_id: str
    incarnation: int
    token_ids: TokenIds
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class Finished(Message, frozen=True):
    """Terminal: the request completed normally; ``stop`` names the stop string that ended it."""

    request_id: str
    incarnation: int
    reason: FinishReason
    usage: Usage
    stop: str | None = None


class Cancelled(Message, frozen=True):
    """Terminal: the request was cancelled or superseded; usage counts tokens made before that."""

    request_id: str
    incarnation: int
    usage: Usage
    reason: str = "cancelled"


class Failed(Message, frozen=True):
    """Terminal: the request failed after it was accepted. ``code`` is stable (see errors.py)."""

    request_id: str
    incarnation: int
    code: str
    message: str
    retryable: bool
    usage: Usage


class Rejected(Message, frozen=True):
    """The router did not accept the request; no other event follows for this incarnation."""

    request_id: str
    incarnation: int
    code: str
    message: str


class ModelLoaded(Message, frozen=True):
    """Reply to ``LoadModel``. ``chat_template``: the model's tokenizer has one; without it chat
    messages are framed in the plain fallback format (docs/chat.md, "Models without a chat
    template"), which a base model continues poorly: send it a raw ``prompt`` instead."""

    model: str
    epoch: int
    reuse_path: str
    bytes_per_token: int
    context_length: int
    chat_template: bool = True
    limits: dict[str, str] = {}  # noqa: RUF012 (capabilities switched off at load, and why)


class ModelUnloaded(Message, frozen=True):
    """Reply to ``UnloadModel``: the engine drained and its memory was released."""

    model: str
    epoch: int


class PrefixesReset(Message, frozen=True):
    """Reply to ``ResetPrefixes``: entries in scope are gone (or doomed while leased)."""

    model: str
    dropped: int


class CommandFailed(Message, frozen=True):
    """Reply to a command (load, unload, reset) that could not be carried out."""

    code: str
    message: str


ModelStateName = Literal["loading", "loaded", "unloading", "restarting", "failed", "idle"]


class ModelStatus(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model the router knows, as ``ListModels`` reports it.

    ``state``: ``loading``, ``loaded``, ``unloading``, ``restarting``, ``failed``, or ``idle``
    (unloaded by its keep-alive; a request loads it again when auto-load is on). ``expires_in_s``:
    seconds until the keep-alive unloads it (None: busy, not loaded, or kept forever).
    """

    name: str
    state: ModelStateName
    epoch: int
    path: str | None
    live_requests: int
    keep_alive_s: float | None
    expires_in_s: float | None = None
    context_length: int | None = None
    failure: str = ""
    placement: str = ""  # an engine in a process of its own: its Ray node and process id
    limits: dict[str, str] = {}  # capabilities switched off at load, and why


class ModelsListed(Message, frozen=True):
    """Reply to ``ListModels``: the router's models, in name order."""

    models: tuple[ModelStatus, ...]


class ShutdownComplete(Message, frozen=True):
    """Reply to ``Shutdown``."""


class Stats(Message, frozen=True):
    """An actor's counters at one moment (immutable snapshot)."""

    actor: str
    counters: dict[str, int]
    gauges: dict[str, int] = {}  # noqa: RUF012 (a msgspec default; ruff cannot see the base here)
    # What the actor cannot do, each with why (an engine: capabilities its load probe switched off)
    limits: dict[str, str] = {}  # noqa: RUF012
