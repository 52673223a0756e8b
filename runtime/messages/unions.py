"""The unions over the message types: each actor's inbox (``RouterInbox``, ``EngineInbox``,
``KVInbox``, ``PrefixInbox``), what the host hears (``HostEvent``, ``CommandReply``), the engine's
sequence events, ``AnyMessage`` and ``ALL_MESSAGE_TYPES``.
"""

from __future__ import annotations

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
from runtime.messages.router_timers import IdleCheck, RequestDeadline, StallCheck
from runtime.messages.vocabulary import Message

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
    | EngineProbed
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
    | CachedElsewhere
)

EngineInbox = (
    EndSession
    | Admit
    | Abort
    | Drain
    | GetStats
    | ComputeDone
    | DiskDone
    | ComputeWatch
    | TidyDue
    | Reserved
    | ReservationRefused
    | LookupResult
    | Committed
    | DropEntries
    | EpochReleased
    | ResetPrefixes
)

KVInbox = (
    Reserve
    | Release
    | Transfer
    | ReleaseEpoch
    | EnginePlaced
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

AnyMessage = RouterInbox | EngineInbox | KVInbox | PrefixInbox | HostEvent | CommandReply

# Complete because this module imports every module that defines a message.
ALL_MESSAGE_TYPES: tuple[type[Message], ...] = tuple(
    sorted({*Message.__subclasses__()}, key=lambda cls: cls.__name__)
)
