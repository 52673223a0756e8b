"""The runtime's one message vocabulary.

Every actor talks only through these frozen msgspec Structs. Heavy state (weights, KV arrays) never
travels: messages carry handles (sequence ids, entry ids, model epochs). Each actor has one inbox
union (``RouterInbox``, ``EngineInbox``, ``KVInbox``, ``PrefixInbox``) and the host receives
``HostEvent``. ``docs/protocols.md`` walks through every protocol with its invariants; in short:

Request lifecycle (host → router → engine → router → host)
    ``Generate``/``Prewarm`` → router validates, assigns a ``sequence_id`` (never reused) and the
    engine's current ``epoch``, sends ``Admit`` → engine tokenizes, reserves KV (``Reserve`` →
    ``Reserved``), looks up the prefix cache (``Lookup`` → ``LookupResult``), prefills in chunks,
    decodes → ``SequenceStarted``, ``TokensProduced``…, exactly one of ``SequenceFinished`` /
    ``SequenceCancelled`` / ``SequenceFailed`` → router → host ``Started``, ``TokensEmitted``…,
    exactly one of ``Finished`` / ``Cancelled`` / ``Failed``. Each engine event is the host event
    it means less the request's identity, which the router adds (``for_request``). A request the
    router will not accept gets ``Rejected`` (and no other event).

Deadlines and the stall guard
    A request with ``timeout_s``, or a stream with no token for its stall timeout, is ended by the
    router itself (``RequestDeadline`` / ``StallCheck`` timers): ``Failed(request_timeout |
    stream_stalled)`` to the host at once, ``Abort`` to the engine, whose later events about that
    sequence are dropped and counted.

Cancellation
    ``Cancel(request_id, incarnation)`` → router → ``Abort(sequence_id, epoch)`` → engine sets that
    sequence's set-once abort flag; the compute thread sees it at the next chunk or step boundary.

Teardown fencing
    ``UnloadModel`` → router stops admitting to the engine → ``Drain(epoch)`` → engine aborts its
    sequences, waits for compute to stop, drops its prefix entries and KV → ``Drained(epoch)`` →
    router stops the engine → ``ModelUnloaded``. Anything carrying an older epoch is dropped and
    counted.

Model keep-alive and auto-load
    A ready model whose last request ended starts an idle spell: the router arms one
    ``IdleCheck(model, epoch, idle_ticket)`` timer for its ``ModelSpec.keep_alive_s``; a request
    ends the spell (the timer, when it fires, is stale: dropped and counted). One that fires in
    its spell unloads the model (teardown fencing) and keeps its spec as *idle*. With
    ``RuntimeConfig.auto_load`` a request for an idle model loads it again, one for a loading
    model is admitted to its engine, and one that meets the idle unload is parked until the
    drain ends. ``ListModels`` → ``ModelsListed``: every model's ``ModelStatus``.

KV budget (engine ↔ keeper ↔ prefix-cache manager)
    ``Reserve`` → ``Reserved`` | ``ReservationRefused`` (after queueing FIFO up to a deadline; the
    keeper asks the prefix manager to ``Evict`` first). ``Transfer`` moves bytes from a sequence to
    the prefix entry it became; ``Release`` returns them (all, or a part the holder no longer
    needs: a decode batch's padding shrinks as rows leave).

Prefix cache (engine ↔ prefix-cache manager)
    ``Lookup`` → ``LookupResult`` (taking a lease on a hit) ; ``Commit`` → ``Committed`` ;
    ``ReleaseLease`` ; ``ResetPrefixes`` ; ``InvalidateEpoch`` ; the manager tells the owning engine
    to ``DropEntries`` it evicted or invalidated.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

from runtime.errors import MalformedMessage

TokenIds = tuple[int, ...]


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True):
    """Base of every message: immutable, strict, tagged with its class name."""


# --------------------------------------------------------------------------- shared value types


class JsonSchemaConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """Generated text must be one JSON value valid under ``schema`` (the schema's JSON text).

    ``strict`` (OpenAI's ``strict: true``) rejects a schema the engine cannot enforce exactly;
    ``strict=False`` lets the engine skip keywords it does not support (e.g. ``format``).
    """

    schema: str
    strict: bool = True


class JsonObjectConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """JSON mode (OpenAI's ``{"type": "json_object"}``): any one JSON object."""


class RegexConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """Generated text must match ``pattern`` in full (Rust ``regex`` syntax, no look-around)."""

    pattern: str


class GrammarConstraint(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag=True
):
    """Generated text must be a sentence of ``grammar``: llguidance's Lark dialect, or GBNF
    (llama.cpp's format, translated to Lark by the engine)."""

    grammar: str
    syntax: Literal["lark", "gbnf"] = "lark"


# What the generated tokens must spell; prompt tokens are never constrained.
Constraint = JsonSchemaConstraint | JsonObjectConstraint | RegexConstraint | GrammarConstraint


class Sampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick the next token. ``temperature == 0`` is greedy; every other default is "off".

    Penalties look at the last ``penalty_context`` tokens (prompt and output). ``logprobs`` asks
    for the chosen token's log-probability, ``top_logprobs`` for that many alternatives.
    ``constraint`` restricts the generated text to a JSON Schema, a regex or a grammar (see
    docs/structured.md): disallowed tokens are masked before the other samplers run.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_n_sigma: float = 0.0  # >0: keep tokens within n standard deviations of the max logit
    xtc_probability: float = 0.0  # exclude-top-choices: chance per step to apply it
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0  # >0: "don't repeat yourself" n-gram penalty
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_context: int = 64
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    constraint: Constraint | None = None


Role = Literal["system", "developer", "user", "assistant", "tool"]


class Tool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A function the model may call: ``parameters`` is its arguments' JSON Schema, as JSON text
    (text keeps the message pure data whatever the schema holds; see runtime/text/tools.py)."""

    name: str
    description: str | None = None
    parameters: str = '{"type": "object", "properties": {}}'


class ToolCall(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One call an assistant message made: ``arguments`` is a JSON object's text."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One chat message as the OpenAI API sends it (text content only).

    An assistant message may carry ``tool_calls`` (its ``content`` then may be empty); a ``tool``
    message answers the call named by ``tool_call_id``.
    """

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None


class ChatOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to prepare a chat prompt (see ``runtime.text.chat``).

    ``history_budget_tokens`` turns on the history window (oldest turns dropped to fit it); when
    ``None`` nothing is ever dropped. ``add_generation_prompt=False`` renders the messages as
    complete turns, with no assistant header and no prefill continuation. ``tools`` are rendered
    into the prompt (by the template when it supports them, else a fallback system section);
    ``parallel_tool_calls=False`` tells the model to make at most one call.
    """

    keep_reasoning: bool = False
    history_budget_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: tuple[Tool, ...] = ()
    parallel_tool_calls: bool = True


class Usage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Token counts of one request, exact on every terminal event."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One emitted token's log-probability and the ``top`` alternatives (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class ReusePath(enum.StrEnum):
    """How a sequence's prompt state was obtained from the prefix cache."""

    EXACT = "exact"  # a whole cached entry is a prefix of the prompt
    TRIM = "trim"  # a trimmable entry cut back to the common prefix
    CHECKPOINT = "checkpoint"  # a non-trimmable snapshot whose tokens prefix the prompt
    ADOPTED = "adopted"  # took over an in-flight prewarm of the same session
    MISS = "miss"  # cold prefill


class FinishReason(enum.StrEnum):
    """Why a sequence stopped normally."""

    STOP = "stop"  # end-of-sequence token or stop string
    LENGTH = "length"  # max_tokens reached
    PREWARMED = "prewarmed"  # a prewarm's state is cached (by itself, or by an identical one)
    ADOPTED = "adopted"  # a prewarm whose work a request that extends it took over


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What to load: ``backend`` names a backend kind ("mlx" or "simulated").

    ``keep_alive_s``: once no request of the model has run for this long, the router unloads it
    (0: as soon as it is idle; None: never). Unloaded so, it stays known: with
    ``RuntimeConfig.auto_load`` a later request loads it again.
    """

    name: str
    backend: str = "mlx"
    path: str | None = None
    options: dict[str, str | int | float | bool | None] = {}
    prefill_chunk_tokens: int = 256
    keep_alive_s: float | None = None


class RequestKind(enum.StrEnum):
    GENERATE = "generate"
    PREWARM = "prewarm"


# --------------------------------------------------------------------------- host → router


class Generate(Message, frozen=True):
    """Start generating. ``incarnation`` is unique per runtime: a recycled ``request_id`` is safe.

    Exactly one of ``prompt`` (text), ``prompt_tokens`` and ``messages`` (chat) is set.
    ``max_tokens`` None: the rest of the context, capped by the engine's default. ``session``
    groups requests that may supersede each other's prewarms (default: model plus namespace);
    with ``supersede`` this request also aborts the session's older generates (a new keystroke).
    ``timeout_s``: the request ends ``Failed(request_timeout)`` that long after the router accepted
    it. ``stall_timeout_s``: it ends ``Failed(stream_stalled)`` when no token came for that long
    after its first (None: ``RuntimeConfig.stall_timeout_s``).
    ``anonymous``: the host cannot tell this request's client from others' (the HTTP server's
    requests without ``session``); it still adopts a prewarm of its session that it extends, but
    it never supersedes another request, and no request supersedes it.
    ``reuse_prefix`` False: prefill the whole prompt, restoring nothing (no prefix-cache lookup,
    no prewarm adopted); the state it leaves is still cached for later requests.
    """

    request_id: str
    incarnation: int
    model: str
    prompt: str | None = None
    prompt_tokens: TokenIds | None = None
    messages: tuple[ChatMessage, ...] | None = None
    chat: ChatOptions = ChatOptions()
    sampling: Sampling = Sampling()
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: TokenIds = ()
    namespace: str = "default"
    session: str | None = None
    supersede: bool = False
    timeout_s: float | None = None
    stall_timeout_s: float | None = None
    anonymous: bool = False
    reuse_prefix: bool = True


class Prewarm(Message, frozen=True):
    """Prefill a prompt and commit its state to the prefix cache, without sampling.

    ``timeout_s``: it ends ``Failed(request_timeout)`` that long after the router accepted it.
    A prewarm supersedes its session's older prewarms, or adopts one it extends; identical
    concurrent prewarms (same tokens and namespace, any session) compute once. ``session`` and
    ``anonymous`` as for ``Generate``.
    """

    request_id: str
    incarnation: int
    model: str
    prompt: str | None = None
    prompt_tokens: TokenIds | None = None
    messages: tuple[ChatMessage, ...] | None = None
    chat: ChatOptions = ChatOptions()
    max_tokens: int | None = None  # of the generate to come: chat windows then render the same
    namespace: str = "default"
    session: str | None = None
    timeout_s: float | None = None
    anonymous: bool = False


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
    """Reply to ``LoadModel``."""

    model: str
    epoch: int
    reuse_path: str
    bytes_per_token: int
    context_length: int


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


class ModelsListed(Message, frozen=True):
    """Reply to ``ListModels``: the router's models, in name order."""

    models: tuple[ModelStatus, ...]


class ShutdownComplete(Message, frozen=True):
    """Reply to ``Shutdown``."""


class Stats(Message, frozen=True):
    """An actor's counters at one moment (immutable snapshot)."""

    actor: str
    counters: dict[str, int]
    gauges: dict[str, int] = {}


# --------------------------------------------------------------------------- router timers


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


# --------------------------------------------------------------------------- router ↔ engine


class Admit(Message, frozen=True):
    """Router → engine: run a new sequence for ``request``, the ``Generate`` or ``Prewarm`` as the
    host sent it.

    Beside it only what the router decided: the ``sequence_id`` (never reused), the engine's
    ``epoch``, and the resolved ``session`` (the request's own, else ``"{model}/{namespace}"``).
    """

    sequence_id: int
    epoch: int
    session: str
    request: Generate | Prewarm


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


class TokensProduced(Message, frozen=True):
    """Engine → router: the host's ``TokensEmitted`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    token_ids: TokenIds
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


class SequenceFinished(Message, frozen=True):
    """Engine → router: the host's ``Finished`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    reason: FinishReason
    usage: Usage
    stop: str | None = None


class SequenceCancelled(Message, frozen=True):
    """Engine → router: the host's ``Cancelled`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    usage: Usage
    reason: str = "cancelled"


class SequenceFailed(Message, frozen=True):
    """Engine → router: the host's ``Failed`` for sequence ``sequence_id``."""

    sequence_id: int
    epoch: int
    code: str
    message: str
    retryable: bool
    usage: Usage


class Drained(Message, frozen=True):
    """Engine → router: nothing of ``epoch`` runs or holds memory any more."""

    epoch: int


# --------------------------------------------------------------------------- KV budget keeper


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
    """

    holder: Holder
    nbytes: int
    timeout_s: float | None = None


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


class EpochReleased(Message, frozen=True):
    """Reply to ``ReleaseEpoch``: nothing of that epoch holds budget any more."""

    model: str
    epoch: int


# --------------------------------------------------------------------------- prefix cache manager


class Lookup(Message, frozen=True):
    """Find the longest usable cached prefix of ``tokens``; answered ``LookupResult``.

    ``sequence_id`` names the sequence that will hold the lease on a hit.
    """

    model: str
    epoch: int
    namespace: str
    tokens: TokenIds
    sequence_id: int


class LookupResult(Message, frozen=True):
    """``entry_id`` None on a miss. ``matched`` tokens of the entry are usable (after trimming).

    ``generation`` counts resets of this (model, namespace); a later ``Commit`` carries it back so
    state computed before a reset can never be committed after it.
    """

    sequence_id: int
    epoch: int
    entry_id: int | None
    matched: int
    path: ReusePath
    lease_id: int | None
    generation: int


class Commit(Message, frozen=True):
    """Register engine-owned state ``entry_id`` whose cache holds exactly ``tokens``.

    ``trimmable`` entries serve any shared prefix; others only when all their tokens prefix a
    prompt, or at one of their ``points``: shorter token counts at which the entry also holds a
    checkpoint of its untrimmable layers (its trimmable layers are cut back to the point).
    ``pinned`` entries are evicted only under a waiting reservation's pressure.
    """

    model: str
    epoch: int
    namespace: str
    entry_id: int
    tokens: TokenIds
    nbytes: int
    trimmable: bool
    generation: int
    pinned: bool = False
    points: tuple[int, ...] = ()


class Committed(Message, frozen=True):
    """Reply to ``Commit``: ``superseded`` lists entries dropped because this one covers them."""

    entry_id: int
    accepted: bool
    superseded: tuple[int, ...] = ()


class ReleaseLease(Message, frozen=True):
    lease_id: int


class Unpin(Message, frozen=True):
    """Engine → prefix manager: entry ``entry_id`` is no longer its session's instructions prefix
    (the instructions changed, or the session ended); it becomes an ordinary LRU entry."""

    model: str
    epoch: int
    entry_id: int


class Evict(Message, frozen=True):
    """Keeper → prefix manager: free at least ``nbytes`` from unleased entries, LRU first."""

    nbytes: int
    include_pinned: bool = False


class InvalidateEpoch(Message, frozen=True):
    """Forget every entry of ``model`` at ``epoch`` (the engine frees the arrays itself)."""

    model: str
    epoch: int


class DropEntries(Message, frozen=True):
    """Prefix manager → engine: free the state of these entries and release their reservations."""

    epoch: int
    entry_ids: tuple[int, ...]


# --------------------------------------------------------------------------- engine internal


class ComputeDone(Message, frozen=True):
    """Engine → itself: the compute job ``job_id`` finished (its result stays in the engine)."""

    job_id: int


class ComputeWatch(Message, frozen=True):
    """Engine → itself (timer): has the compute step in flight overrun ``step_timeout_s``?"""


# --------------------------------------------------------------------------- unions

RouterInbox = (
    EndSession
    | Generate
    | Prewarm
    | Cancel
    | LoadModel
    | UnloadModel
    | ResetPrefixes
    | GetStats
    | Shutdown
    | EngineReady
    | EngineLoadFailed
    | EngineFailed
    | SequenceStarted
    | TokensProduced
    | SequenceFinished
    | SequenceCancelled
    | SequenceFailed
    | Drained
    | PrefixesReset
    | SessionEnded
    | RequestDeadline
    | StallCheck
    | IdleCheck
    | ListModels
)

EngineInbox = (
    EndSession
    | Admit
    | Abort
    | Drain
    | GetStats
    | ComputeDone
    | ComputeWatch
    | Reserved
    | ReservationRefused
    | LookupResult
    | Committed
    | DropEntries
    | EpochReleased
)

KVInbox = (
    Reserve
    | Release
    | Transfer
    | ReleaseEpoch
    | ReservationExpired
    | ReservationPressure
    | GetStats
)

PrefixInbox = (
    Lookup | Commit | ReleaseLease | Unpin | Evict | InvalidateEpoch | ResetPrefixes | GetStats
)

HostEvent = Started | TokensEmitted | Finished | Cancelled | Failed | Rejected
TerminalEvent = Finished | Cancelled | Failed
RequestEvent = Started | TokensEmitted | TerminalEvent  # what an accepted request hears

EngineTerminal = SequenceFinished | SequenceCancelled | SequenceFailed
EngineEvent = SequenceStarted | TokensProduced | EngineTerminal

CommandReply = (
    SessionEnded
    | ModelLoaded
    | ModelUnloaded
    | PrefixesReset
    | CommandFailed
    | ShutdownComplete
    | Stats
    | ModelsListed
)

# --------------------------------------------------------------------------- engine → host events

# Each engine event is the host event it means, less the request's identity (only the router knows
# it) and plus the sequence's (which routes it). tests/test_messages.py checks the fields agree.
_HOST_EVENT: dict[type[EngineEvent], type[RequestEvent]] = {
    SequenceStarted: Started,
    TokensProduced: TokensEmitted,
    SequenceFinished: Finished,
    SequenceCancelled: Cancelled,
    SequenceFailed: Failed,
}
_REQUEST_IDENTITY = ("request_id", "incarnation")


def for_request(event: EngineEvent, request_id: str, incarnation: int) -> RequestEvent:
    """The host event that ``event`` means, for request ``(request_id, incarnation)``.

    Every other field is the engine event's own value, so the two cannot drift apart field by
    field; ``Started`` keeps the sequence id and epoch, the others drop them.
    """
    host_event = _HOST_EVENT[type(event)]
    fields = {
        name: getattr(event, name)
        for name in host_event.__struct_fields__
        if name not in _REQUEST_IDENTITY
    }
    return host_event(request_id=request_id, incarnation=incarnation, **fields)


AnyMessage = RouterInbox | EngineInbox | KVInbox | PrefixInbox | HostEvent | CommandReply

ALL_MESSAGE_TYPES: tuple[type[Message], ...] = tuple(
    sorted({*Message.__subclasses__()}, key=lambda cls: cls.__name__)
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[AnyMessage] = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    """Serialize a message with msgpack (the wire form a multi-host transport would use)."""
    return _encoder.encode(message)


def decode(data: bytes) -> AnyMessage:
    """Inverse of ``encode``; raises ``MalformedMessage`` on anything not in the vocabulary.

    Decodes into the closed union of every message type.
    """
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as error:  # ValidationError included: a tag or field is wrong
        raise MalformedMessage(
            f"the bytes are not a runtime message ({error}); send what messages.encode made"
        ) from error
