"""The message vocabulary: every message survives the wire form, is immutable and strict.

``BUILDERS`` holds one representative instance per message type, with non-default values wherever
a field has a default, so a field that does not round-trip shows up. A new message type without a
builder fails ``test_every_message_type_has_a_builder``.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest

from runtime.errors import MalformedMessage
from runtime.messages import (
    ALL_MESSAGE_TYPES,
    Abort,
    Admit,
    CachedElsewhere,
    Cancel,
    Cancelled,
    ChatMessage,
    ChatOptions,
    CommandFailed,
    Commit,
    Committed,
    ComputeDone,
    ComputeWatch,
    DiskDone,
    Drain,
    Drained,
    DropEntries,
    EndSession,
    EngineFailed,
    EngineLoadFailed,
    EnginePlaced,
    EngineProbed,
    EngineReady,
    EpochReleased,
    Evict,
    Failed,
    Finished,
    FinishReason,
    Generate,
    GetStats,
    Holder,
    HolderKind,
    IdleCheck,
    InvalidateEpoch,
    ListModels,
    LoadModel,
    Lookup,
    LookupResult,
    Message,
    ModelLoaded,
    ModelsListed,
    ModelSpec,
    ModelStatus,
    ModelUnloaded,
    PrefixesReset,
    Prewarm,
    Rejected,
    Release,
    ReleaseEpoch,
    ReleaseLease,
    RequestDeadline,
    ReservationExpired,
    ReservationPressure,
    ReservationRefused,
    Reserve,
    Reserved,
    ResetPrefixes,
    ReusePath,
    Sampling,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    SessionEnded,
    Shutdown,
    ShutdownComplete,
    StallCheck,
    Started,
    Stats,
    TidyDue,
    TokensEmitted,
    TokensProduced,
    Transfer,
    UnloadModel,
    Unpin,
    Usage,
    decode,
    encode,
)
from runtime.testing.requests import generate, prewarm

SAMPLING = Sampling(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11)
USAGE = Usage(prompt_tokens=12, cached_prompt_tokens=8, completion_tokens=3)
SEQ_HOLDER = Holder(model="m", epoch=3, kind=HolderKind.SEQUENCE, id=17)
ENTRY_HOLDER = Holder(model="m", epoch=3, kind=HolderKind.PREFIX_ENTRY, id=5)
PADDING_HOLDER = Holder(model="m", epoch=3, kind=HolderKind.BATCH_PADDING, id=2)
SPEC = ModelSpec(
    name="m",
    backend="simulated",
    path="/models/m",
    options={"trimmable": False, "bytes_per_token": 64, "prefill_s_per_token": 0.001, "x": None},
    prefill_chunk_tokens=32,
)

BUILDERS: dict[type[Message], Callable[[], Message]] = {
    # host → router
    Generate: lambda: generate(
        "r1",
        (1, 2, 3),
        9,
        incarnation=4,
        sampling=SAMPLING,
        stop_token_ids=(256,),
        namespace="tenant-a",
        session="s1",
        timeout_s=2.5,
        stall_timeout_s=0.5,
    ),
    Prewarm: lambda: prewarm(
        "r2", incarnation=5, prompt="héllo ✓", namespace="t", session="s", timeout_s=1.5
    ),
    Cancel: lambda: Cancel(request_id="r1", incarnation=4),
    LoadModel: lambda: LoadModel(spec=SPEC),
    UnloadModel: lambda: UnloadModel(model="m"),
    ResetPrefixes: lambda: ResetPrefixes(model="m", namespace="tenant-a"),
    GetStats: GetStats,
    Shutdown: Shutdown,
    # router → host
    Started: lambda: Started(
        request_id="r1",
        incarnation=4,
        sequence_id=17,
        epoch=3,
        prompt_tokens=12,
        cached_tokens=8,
        path=ReusePath.CHECKPOINT,
    ),
    TokensEmitted: lambda: TokensEmitted(
        request_id="r1", incarnation=4, token_ids=(104, 105), text="hi"
    ),
    Finished: lambda: Finished(
        request_id="r1", incarnation=4, reason=FinishReason.LENGTH, usage=USAGE
    ),
    Cancelled: lambda: Cancelled(request_id="r1", incarnation=4, usage=USAGE, reason="superseded"),
    Failed: lambda: Failed(
        request_id="r1",
        incarnation=4,
        code="kv_budget_exhausted",
        message="waited too long",
        retryable=True,
        usage=USAGE,
    ),
    Rejected: lambda: Rejected(
        request_id="r1", incarnation=4, code="model_not_loaded", message="load it first"
    ),
    ModelLoaded: lambda: ModelLoaded(
        model="m", epoch=3, reuse_path="trim", bytes_per_token=64, context_length=4096
    ),
    ModelUnloaded: lambda: ModelUnloaded(model="m", epoch=3),
    PrefixesReset: lambda: PrefixesReset(model="m", dropped=2),
    CommandFailed: lambda: CommandFailed(code="model_already_loaded", message="unload it first"),
    ShutdownComplete: ShutdownComplete,
    Stats: lambda: Stats(actor="kv", counters={"granted": 3}, gauges={"free": 100}),
    # router ↔ engine
    Admit: lambda: Admit(
        sequence_id=17,
        epoch=3,
        session="m/tenant-a",
        request=prewarm(
            "r2",
            incarnation=5,
            messages=(ChatMessage(role="user", content="hi"),),
            chat=ChatOptions(history_budget_tokens=100),
            namespace="tenant-a",
        ),
    ),
    Abort: lambda: Abort(sequence_id=17, epoch=3, reason="superseded"),
    Drain: lambda: Drain(epoch=3),
    EngineReady: lambda: EngineReady(
        epoch=3, reuse_path="checkpoint", bytes_per_token=64, context_length=4096
    ),
    EngineProbed: lambda: EngineProbed(
        epoch=3, reuse_path="trim", limits={"batch_decode": "differs from a plain run"}
    ),
    EngineLoadFailed: lambda: EngineLoadFailed(epoch=3, code="model_load_failed", message="gone"),
    EngineFailed: lambda: EngineFailed(epoch=3, code="step_timeout", message="stuck"),
    SequenceStarted: lambda: SequenceStarted(
        sequence_id=17, epoch=3, prompt_tokens=12, cached_tokens=8, path=ReusePath.ADOPTED
    ),
    TokensProduced: lambda: TokensProduced(sequence_id=17, epoch=3, token_ids=(104,), text="h"),
    SequenceFinished: lambda: SequenceFinished(
        sequence_id=17, epoch=3, reason=FinishReason.PREWARMED, usage=USAGE
    ),
    SequenceCancelled: lambda: SequenceCancelled(
        sequence_id=17, epoch=3, usage=USAGE, reason="model_unloaded"
    ),
    SequenceFailed: lambda: SequenceFailed(
        sequence_id=17,
        epoch=3,
        code="backend_error",
        message="step failed",
        retryable=True,
        usage=USAGE,
    ),
    Drained: lambda: Drained(epoch=3),
    # router timers
    RequestDeadline: lambda: RequestDeadline(sequence_id=17),
    StallCheck: lambda: StallCheck(sequence_id=17),
    IdleCheck: lambda: IdleCheck(model="m", epoch=3, idle_ticket=9),
    ListModels: ListModels,
    ModelsListed: lambda: ModelsListed(
        models=(
            ModelStatus(
                name="m",
                state="loaded",
                epoch=2,
                path="/models/m",
                live_requests=1,
                keep_alive_s=300.0,
                expires_in_s=12.5,
                context_length=2048,
            ),
        )
    ),
    # KV budget keeper
    Reserve: lambda: Reserve(holder=SEQ_HOLDER, nbytes=4096, timeout_s=1.5),
    Reserved: lambda: Reserved(holder=SEQ_HOLDER, nbytes=4096),
    ReservationRefused: lambda: ReservationRefused(
        holder=SEQ_HOLDER,
        nbytes=4096,
        code="kv_request_too_large",
        message="larger than the budget",
        retryable=False,
    ),
    Release: lambda: Release(holder=PADDING_HOLDER, nbytes=512),
    Transfer: lambda: Transfer(source=SEQ_HOLDER, target=ENTRY_HOLDER, nbytes=1024),
    ReservationExpired: lambda: ReservationExpired(holder=SEQ_HOLDER, ticket=9),
    ReleaseEpoch: lambda: ReleaseEpoch(model="m", epoch=3),
    EpochReleased: lambda: EpochReleased(model="m", epoch=3),
    EnginePlaced: lambda: EnginePlaced(model="m@1", epoch=3, node="ab12", node_ip="10.0.0.2"),
    Unpin: lambda: Unpin(model="m", epoch=3, entry_id=5),
    ReservationPressure: lambda: ReservationPressure(holder=SEQ_HOLDER, ticket=4),
    EndSession: lambda: EndSession(model="m", session="editor", namespace="tenant-a"),
    SessionEnded: lambda: SessionEnded(model="m", session="editor", unpinned=True),
    # prefix-cache manager
    Lookup: lambda: Lookup(model="m", epoch=3, namespace="t", tokens=(1, 2, 3), sequence_id=17),
    LookupResult: lambda: LookupResult(
        sequence_id=17,
        epoch=3,
        entry_id=5,
        matched=2,
        path=ReusePath.TRIM,
        lease_id=8,
        generation=1,
    ),
    CachedElsewhere: lambda: CachedElsewhere(
        sequence_id=17, epoch=3, model="m@0", elsewhere="m@1", matched_here=2, matched_there=40
    ),
    Commit: lambda: Commit(
        model="m",
        epoch=3,
        namespace="t",
        entry_id=5,
        tokens=(1, 2, 3),
        nbytes=192,
        trimmable=False,
        generation=1,
        pinned=True,
        points=(1, 2),
    ),
    Committed: lambda: Committed(entry_id=5, accepted=True, superseded=(2, 4)),
    ReleaseLease: lambda: ReleaseLease(lease_id=8),
    Evict: lambda: Evict(nbytes=2048, include_pinned=True, epochs=(("m@0", 3),)),
    InvalidateEpoch: lambda: InvalidateEpoch(model="m", epoch=3),
    DropEntries: lambda: DropEntries(epoch=3, entry_ids=(5, 6)),
    # engine internal
    ComputeDone: lambda: ComputeDone(job_id=42),
    DiskDone: lambda: DiskDone(job_id=7),
    ComputeWatch: lambda: ComputeWatch(),
    TidyDue: lambda: TidyDue(idle_period=3),
}

TYPES = sorted(BUILDERS, key=lambda cls: cls.__name__)


def _ids(cls: type[Message]) -> str:
    return cls.__name__


def test_every_message_type_has_a_builder() -> None:
    missing = sorted(cls.__name__ for cls in ALL_MESSAGE_TYPES if cls not in BUILDERS)
    assert not missing, f"add a builder to BUILDERS for: {', '.join(missing)}"
    unknown = sorted(cls.__name__ for cls in BUILDERS if cls not in ALL_MESSAGE_TYPES)
    assert not unknown, f"BUILDERS names types outside ALL_MESSAGE_TYPES: {', '.join(unknown)}"


@pytest.mark.parametrize("cls", TYPES, ids=_ids)
def test_round_trips_through_the_wire_form(cls: type[Message]) -> None:
    message = BUILDERS[cls]()
    assert type(message) is cls
    decoded = decode(encode(message))
    assert type(decoded) is cls
    assert decoded == message


@pytest.mark.parametrize("cls", TYPES, ids=_ids)
def test_wire_form_is_tagged_with_the_class_name(cls: type[Message]) -> None:
    as_dict = msgspec.msgpack.decode(encode(BUILDERS[cls]()))
    assert as_dict["type"] == cls.__name__


def test_enum_and_nested_values_come_back_typed() -> None:
    started = decode(encode(BUILDERS[Started]()))
    assert isinstance(started, Started)
    assert started.path is ReusePath.CHECKPOINT
    reserve = decode(encode(BUILDERS[Reserve]()))
    assert isinstance(reserve, Reserve)
    assert reserve.holder == SEQ_HOLDER
    assert reserve.holder.kind is HolderKind.SEQUENCE
    generate = decode(encode(BUILDERS[Generate]()))
    assert isinstance(generate, Generate)
    assert generate.request.sampling == SAMPLING
    assert isinstance(generate.request.prompt_tokens, tuple)


@pytest.mark.parametrize("request_type", [Generate, Prewarm], ids=_ids)
def test_admit_carries_the_request_it_came_from_with_its_type(
    request_type: type[Generate | Prewarm],
) -> None:
    request = BUILDERS[request_type]()
    assert isinstance(request, Generate | Prewarm)
    admit = Admit(sequence_id=17, epoch=3, session="s", request=request)
    decoded = decode(encode(admit))
    assert isinstance(decoded, Admit)
    assert type(decoded.request) is request_type
    assert decoded.request == request


@pytest.mark.parametrize("cls", TYPES, ids=_ids)
def test_messages_are_frozen(cls: type[Message]) -> None:
    message = BUILDERS[cls]()
    field_name = cls.__struct_fields__[0] if cls.__struct_fields__ else "anything"
    with pytest.raises(AttributeError):
        setattr(message, field_name, None)


def test_nested_value_types_are_frozen() -> None:
    with pytest.raises(AttributeError):
        SAMPLING.temperature = 0.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        SEQ_HOLDER.id = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        USAGE.prompt_tokens = 0  # type: ignore[misc]


@pytest.mark.parametrize("cls", TYPES, ids=_ids)
def test_unknown_fields_are_refused(cls: type[Message]) -> None:
    as_dict = msgspec.to_builtins(BUILDERS[cls]())
    as_dict["not_a_field"] = 1
    with pytest.raises(MalformedMessage, match="not_a_field"):
        decode(msgspec.msgpack.encode(as_dict))


def test_unknown_fields_in_nested_values_are_refused() -> None:
    as_dict = msgspec.to_builtins(BUILDERS[Generate]())
    as_dict["request"]["sampling"]["temprature"] = 0.5
    with pytest.raises(MalformedMessage, match="temprature"):
        decode(msgspec.msgpack.encode(as_dict))
    as_dict = msgspec.to_builtins(BUILDERS[Generate]())
    as_dict["request"]["max_tokns"] = 5  # the request value is as strict as the message
    with pytest.raises(MalformedMessage, match="max_tokns"):
        decode(msgspec.msgpack.encode(as_dict))


def test_unknown_message_type_is_refused() -> None:
    with pytest.raises(MalformedMessage):
        decode(msgspec.msgpack.encode({"type": "Teleport", "to": "mars"}))


def test_wrong_field_type_is_refused() -> None:
    as_dict = msgspec.to_builtins(BUILDERS[Abort]())
    as_dict["epoch"] = "three"
    with pytest.raises(MalformedMessage):
        decode(msgspec.msgpack.encode(as_dict))
