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
    it means less the request's identity, which the router adds (each event's ``for_request``).
    A request the router will not accept gets ``Rejected`` (and no other event).

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

Modules (each name is re-exported here: import from ``runtime.messages``)
    ``vocabulary``: the ``Message`` base and the value types messages carry. ``host``: host ↔
    router requests, commands, events and replies. ``router_timers``: the router's own timers.
    ``engine``: router ↔ engine, and the engine's own messages. ``kv_budget`` and
    ``prefix_cache``: those actors' protocols. ``unions``: the inboxes, the event unions and
    ``wire``: ``encode`` / ``decode``.
"""

from runtime.messages.engine import (
    Abort,
    Admit,
    ComputeDone,
    ComputeWatch,
    DiskDone,
    Drain,
    Drained,
    EngineFailed,
    EngineLoadFailed,
    EngineProbed,
    EngineReady,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    TidyDue,
    TokensProduced,
)
from runtime.messages.host import (
    Cancel,
    Cancelled,
    CommandFailed,
    EndSession,
    Failed,
    Finished,
    Generate,
    GetStats,
    ListModels,
    LoadModel,
    ModelLoaded,
    ModelsListed,
    ModelStateName,
    ModelStatus,
    ModelUnloaded,
    PrefixesReset,
    Prewarm,
    Rejected,
    ResetPrefixes,
    SessionEnded,
    Shutdown,
    ShutdownComplete,
    Started,
    Stats,
    TokensEmitted,
    UnloadModel,
)
from runtime.messages.kv_budget import (
    EnginePlaced,
    EpochReleased,
    Holder,
    HolderKind,
    Release,
    ReleaseEpoch,
    ReservationExpired,
    ReservationPressure,
    ReservationRefused,
    Reserve,
    Reserved,
    Transfer,
)
from runtime.messages.prefix_cache import (
    CachedElsewhere,
    Commit,
    Committed,
    DropEntries,
    Evict,
    InvalidateEpoch,
    Lookup,
    LookupResult,
    ReleaseLease,
    Unpin,
)
from runtime.messages.request import GENERATE_ONLY, PREWARM_ONLY, Request
from runtime.messages.router_timers import IdleCheck, RequestDeadline, StallCheck
from runtime.messages.unions import (
    ALL_MESSAGE_TYPES,
    AnyMessage,
    CommandReply,
    EngineEvent,
    EngineInbox,
    EngineTerminal,
    HostEvent,
    KVInbox,
    PrefixInbox,
    RequestEvent,
    RouterInbox,
    TerminalEvent,
)
from runtime.messages.vocabulary import (
    IMAGE_PLACEHOLDER,
    ChatMessage,
    ChatOptions,
    Constraint,
    FinishReason,
    GrammarConstraint,
    ImagePart,
    JsonObjectConstraint,
    JsonSchemaConstraint,
    Message,
    ModelSpec,
    PromptFacts,
    RegexConstraint,
    RequestKind,
    ReusePath,
    ReuseTier,
    Role,
    Sampling,
    TokenIds,
    TokenLogprob,
    Tool,
    ToolCall,
    Usage,
)
from runtime.messages.wire import decode, encode

__all__ = [
    # vocabulary
    "PromptFacts",
    "TokenIds",
    "Message",
    "JsonSchemaConstraint",
    "JsonObjectConstraint",
    "RegexConstraint",
    "GrammarConstraint",
    "Constraint",
    "Sampling",
    "Role",
    "Tool",
    "ToolCall",
    "ChatMessage",
    "ChatOptions",
    "IMAGE_PLACEHOLDER",
    "ImagePart",
    "Usage",
    "TokenLogprob",
    "ReusePath",
    "ReuseTier",
    "FinishReason",
    "ModelSpec",
    "RequestKind",
    # host
    "GENERATE_ONLY",
    "Generate",
    "PREWARM_ONLY",
    "Prewarm",
    "Cancel",
    "LoadModel",
    "UnloadModel",
    "ResetPrefixes",
    "EndSession",
    "SessionEnded",
    "GetStats",
    "ListModels",
    "Shutdown",
    "Started",
    "TokensEmitted",
    "Finished",
    "Cancelled",
    "Failed",
    "Rejected",
    "Request",
    "ModelLoaded",
    "ModelUnloaded",
    "PrefixesReset",
    "CommandFailed",
    "ModelStateName",
    "ModelStatus",
    "ModelsListed",
    "ShutdownComplete",
    "Stats",
    # router_timers
    "RequestDeadline",
    "StallCheck",
    "IdleCheck",
    # engine
    "Admit",
    "Abort",
    "Drain",
    "EngineProbed",
    "EngineReady",
    "EngineLoadFailed",
    "EngineFailed",
    "SequenceStarted",
    "TokensProduced",
    "SequenceFinished",
    "SequenceCancelled",
    "SequenceFailed",
    "Drained",
    "ComputeDone",
    "DiskDone",
    "ComputeWatch",
    "TidyDue",
    # kv_budget
    "HolderKind",
    "Holder",
    "Reserve",
    "Reserved",
    "ReservationRefused",
    "Release",
    "Transfer",
    "ReservationExpired",
    "ReservationPressure",
    "ReleaseEpoch",
    "EnginePlaced",
    "EpochReleased",
    # prefix_cache
    "Lookup",
    "LookupResult",
    "CachedElsewhere",
    "Commit",
    "Committed",
    "ReleaseLease",
    "Unpin",
    "Evict",
    "InvalidateEpoch",
    "DropEntries",
    # unions
    "RouterInbox",
    "EngineInbox",
    "KVInbox",
    "PrefixInbox",
    "HostEvent",
    "TerminalEvent",
    "RequestEvent",
    "EngineTerminal",
    "EngineEvent",
    "CommandReply",
    "AnyMessage",
    "ALL_MESSAGE_TYPES",
    # wire
    "encode",
    "decode",
]
