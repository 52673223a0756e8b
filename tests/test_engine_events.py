"""Engine events become host events: each engine event is the host event it means, less the
request's identity, which the router adds (each engine event's ``for_request``)."""

from __future__ import annotations

import msgspec
import pytest

from actors.router import RouterCore
from runtime.kernel.core import ROUTER, engine_address
from runtime.messages import (
    Admit,
    Cancelled,
    EngineEvent,
    EngineReady,
    Failed,
    Finished,
    FinishReason,
    LoadModel,
    Message,
    ModelLoaded,
    ModelSpec,
    RequestEvent,
    ReusePath,
    SequenceCancelled,
    SequenceFailed,
    SequenceFinished,
    SequenceStarted,
    Started,
    TokenLogprob,
    TokensEmitted,
    TokensProduced,
    Usage,
    encode,
)
from runtime.testing.recording import RecordingContext, idle_engine
from runtime.testing.requests import generate

USAGE = Usage(prompt_tokens=12, cached_prompt_tokens=8, completion_tokens=3)
LOGPROB = TokenLogprob(token=104, logprob=-0.5, top=((104, -0.5), (105, -1.5)))

# Non-default values wherever a field has a default, so a field left behind shows up.
PAIRS: list[tuple[EngineEvent, RequestEvent]] = [
    (
        SequenceStarted(
            sequence_id=17, epoch=3, prompt_tokens=12, cached_tokens=8,
            path=ReusePath.CHECKPOINT, dropped_turns=2,
        ),
        Started(
            request_id="r", incarnation=4, sequence_id=17, epoch=3, prompt_tokens=12,
            cached_tokens=8, path=ReusePath.CHECKPOINT, dropped_turns=2,
        ),
    ),
    (
        TokensProduced(sequence_id=17, epoch=3, token_ids=(104,), text="h", logprobs=(LOGPROB,)),
        TokensEmitted(
            request_id="r", incarnation=4, token_ids=(104,), text="h", logprobs=(LOGPROB,)
        ),
    ),
    (
        SequenceFinished(sequence_id=17, epoch=3, reason=FinishReason.STOP, usage=USAGE, stop="##"),
        Finished(request_id="r", incarnation=4, reason=FinishReason.STOP, usage=USAGE, stop="##"),
    ),
    (
        SequenceCancelled(sequence_id=17, epoch=3, usage=USAGE, reason="superseded"),
        Cancelled(request_id="r", incarnation=4, usage=USAGE, reason="superseded"),
    ),
    (
        SequenceFailed(
            sequence_id=17, epoch=3, code="backend_error", message="boom", retryable=True,
            usage=USAGE,
        ),
        Failed(
            request_id="r", incarnation=4, code="backend_error", message="boom", retryable=True,
            usage=USAGE,
        ),
    ),
]  # fmt: skip

ROUTING = {"sequence_id", "epoch"}
IDENTITY = {"request_id", "incarnation"}


def _name(pair: tuple[EngineEvent, RequestEvent]) -> str:
    return type(pair[0]).__name__


def _fields(cls: type[Message], leave_out: set[str]) -> list[msgspec.structs.FieldInfo]:
    return [f for f in msgspec.structs.fields(cls) if f.name not in leave_out]


@pytest.mark.parametrize("pair", PAIRS, ids=_name)
def test_an_engine_event_has_its_host_events_fields_less_the_request_identity(
    pair: tuple[EngineEvent, RequestEvent],
) -> None:
    engine_type, host_type = type(pair[0]), type(pair[1])
    kept_routing = ROUTING & set(host_type.__struct_fields__)

    # Same names, types, defaults and order: for_request copies each one (PAIRS checks values).
    assert _fields(engine_type, ROUTING - kept_routing) == _fields(host_type, IDENTITY)


@pytest.mark.parametrize("pair", PAIRS, ids=_name)
def test_for_request_builds_the_host_event_byte_for_byte(
    pair: tuple[EngineEvent, RequestEvent],
) -> None:
    event, expected = pair

    host_event = event.for_request("r", 4)

    assert type(host_event) is type(expected)
    assert host_event == expected
    assert encode(host_event) == encode(expected)


ENGINE = engine_address("m", 1)


def _router_running_request_r(ctx: RecordingContext) -> tuple[RouterCore, Admit]:
    router = RouterCore(engine_factory=idle_engine)
    router.handle(LoadModel(spec=ModelSpec(name="m", backend="simulated")), "host:load", ctx)
    ready = EngineReady(epoch=1, reuse_path="trim", bytes_per_token=1, context_length=64)
    router.handle(ready, ENGINE, ctx)
    router.handle(generate("r", max_tokens=None, incarnation=4, prompt="hi"), "host", ctx)
    sent = ctx.take_sent()
    assert [type(m) for _, m in sent] == [ModelLoaded, Admit]
    admit = sent[1][1]
    assert isinstance(admit, Admit)
    return router, admit


def test_the_router_forwards_each_engine_event_as_the_host_event_it_means() -> None:
    ctx = RecordingContext(ROUTER)
    router, admit = _router_running_request_r(ctx)
    ours = {"sequence_id": admit.sequence_id, "epoch": admit.epoch}

    for event, _ in PAIRS[:3]:  # started, tokens, finished
        router.handle(msgspec.structs.replace(event, **ours), ENGINE, ctx)

    expected = [host for _, host in PAIRS[:3]]
    expected[0] = msgspec.structs.replace(expected[0], **ours)
    assert ctx.take_sent() == [("host", e) for e in expected]
    assert router.live_sequences() == {}
    assert router.statistics().counters["terminal_finished"] == 1


def test_an_engine_event_of_another_epoch_or_an_ended_sequence_is_a_counted_dead_letter() -> None:
    ctx = RecordingContext(ROUTER)
    router, admit = _router_running_request_r(ctx)
    finished = PAIRS[2][0]
    assert isinstance(finished, SequenceFinished)
    current = msgspec.structs.replace(finished, sequence_id=admit.sequence_id, epoch=admit.epoch)
    old_epoch = msgspec.structs.replace(current, epoch=admit.epoch - 1)

    router.handle(old_epoch, ENGINE, ctx)
    assert ctx.take_sent() == []
    router.handle(current, ENGINE, ctx)
    router.handle(current, ENGINE, ctx)  # the sequence has ended

    assert [type(m) for _, m in ctx.take_sent()] == [Finished]
    assert ctx.dead_letters["stale_engine_event"] == 2
    assert router.statistics().counters["stale_engine_events"] == 2


def test_a_message_outside_the_routers_inbox_is_a_counted_dead_letter() -> None:
    ctx = RecordingContext(ROUTER)
    router = RouterCore(engine_factory=idle_engine)

    router.handle(PAIRS[0][1], "somebody", ctx)  # a host event is never the router's mail

    assert ctx.take_sent() == []
    assert ctx.dead_letters == {"router_unexpected": 1}
