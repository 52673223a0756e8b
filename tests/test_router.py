"""Example tests of the router's command replies, driving its core with a recording context."""

from __future__ import annotations

import pytest

from actors.router import RouterCore
from runtime.kernel.core import PREFIX_CACHE, ROUTER, Address, engine_address
from runtime.kernel.supervision import RestartPolicy
from runtime.messages import (
    EndSession,
    EngineFailed,
    EngineReady,
    Failed,
    LoadModel,
    ModelLoaded,
    ModelSpec,
    ModelUnloaded,
    PrefixesReset,
    Rejected,
    ResetPrefixes,
    SessionEnded,
    UnloadModel,
    Usage,
)
from runtime.testing.recording import RecordingContext, idle_engine
from runtime.testing.requests import generate

ENGINE_A = engine_address("a", 1)
ENGINE_B = engine_address("b", 2)


@pytest.fixture
def ctx() -> RecordingContext:
    return RecordingContext(ROUTER)


@pytest.fixture
def router(ctx: RecordingContext) -> RouterCore:
    """A router with models "a" (epoch 1) and "b" (epoch 2) ready."""
    router = RouterCore(engine_factory=idle_engine)
    for name, epoch in (("a", 1), ("b", 2)):
        router.handle(LoadModel(spec=ModelSpec(name=name, backend="simulated")), "host:load", ctx)
        ready = EngineReady(epoch=epoch, reuse_path="trim", bytes_per_token=1, context_length=64)
        router.handle(ready, engine_address(name, epoch), ctx)
    assert [type(m) for _, m in ctx.take_sent()] == [ModelLoaded, ModelLoaded]
    return router


def test_session_replies_reach_their_own_askers_when_engines_answer_out_of_order(
    router: RouterCore, ctx: RecordingContext
) -> None:
    router.handle(EndSession(model="a", session="s1"), "host:ask:1", ctx)
    router.handle(EndSession(model="b", session="s2"), "host:ask:2", ctx)
    assert ctx.take_sent() == [
        (ENGINE_A, EndSession(model="a", session="s1")),
        (ENGINE_B, EndSession(model="b", session="s2")),
    ]
    from_b = SessionEnded(model="b", session="s2", unpinned=False)
    from_a = SessionEnded(model="a", session="s1", unpinned=True)
    router.handle(from_b, ENGINE_B, ctx)  # the later ask is answered first
    router.handle(from_a, ENGINE_A, ctx)
    assert ctx.take_sent() == [("host:ask:2", from_b), ("host:ask:1", from_a)]


def test_two_asks_for_one_session_are_answered_in_the_order_the_engine_answers_them(
    router: RouterCore, ctx: RecordingContext
) -> None:
    router.handle(EndSession(model="a", session="s", namespace="x"), "host:ask:1", ctx)
    router.handle(EndSession(model="a", session="s", namespace="y"), "host:ask:2", ctx)
    ctx.take_sent()
    first = SessionEnded(model="a", session="s", unpinned=True)
    second = SessionEnded(model="a", session="s", unpinned=False)
    router.handle(first, ENGINE_A, ctx)  # one engine answers its mailbox in order
    router.handle(second, ENGINE_A, ctx)
    assert ctx.take_sent() == [("host:ask:1", first), ("host:ask:2", second)]


@pytest.mark.parametrize(
    ("reply", "sender"),
    [
        (SessionEnded(model="a", session="nobody-asked", unpinned=False), ENGINE_A),
        (SessionEnded(model="a", session="s1", unpinned=False), ENGINE_B),  # not the one asked
        (PrefixesReset(model="a", dropped=0), PREFIX_CACHE),
    ],
    ids=["unknown-session", "other-engine", "prefixes-reset"],
)
def test_an_unsolicited_reply_is_a_counted_dead_letter_and_the_router_goes_on(
    router: RouterCore, ctx: RecordingContext, reply: SessionEnded | PrefixesReset, sender: Address
) -> None:
    router.handle(EndSession(model="a", session="s1"), "host:ask:1", ctx)
    ctx.take_sent()
    router.handle(reply, sender, ctx)
    assert ctx.take_sent() == []
    assert sum(ctx.dead_letters.values()) == 1
    assert router.statistics().counters["unmatched_replies"] == 1
    # The real reply still reaches the asker: the stray one took nobody's place.
    ended = SessionEnded(model="a", session="s1", unpinned=True)
    router.handle(ended, ENGINE_A, ctx)
    assert ctx.take_sent() == [("host:ask:1", ended)]
    router.handle(ResetPrefixes(model="b"), "host:ask:2", ctx)
    reset = PrefixesReset(model="b", dropped=3)
    router.handle(reset, PREFIX_CACHE, ctx)
    # The engine hears the reset too (its disk tier forgets the scope), then the asker its reply.
    assert ctx.take_sent() == [
        (PREFIX_CACHE, ResetPrefixes(model="b")),
        ("engine:b#2", ResetPrefixes(model="b")),
        ("host:ask:2", reset),
    ]


def test_an_engine_that_gave_up_is_replaced_and_what_it_left_live_fails_retryably(
    router: RouterCore, ctx: RecordingContext
) -> None:
    router.handle(generate("r", max_tokens=None, model="a", prompt="x"), "host", ctx)
    assert [to for to, _ in ctx.take_sent()] == [ENGINE_A]  # admitted; the engine never answers
    gave_up = EngineFailed(epoch=1, code="step_timeout", message="stuck")
    router.handle(gave_up, ENGINE_A, ctx)
    failed = Failed(
        request_id="r",
        incarnation=1,
        code="step_timeout",
        message="stuck",
        retryable=True,
        usage=Usage(),
    )
    assert ctx.take_sent() == [("host", failed)]
    assert ctx.stopped == [ENGINE_A]
    assert ctx.spawned[-1][0] == engine_address("a", 3)  # reloaded at a new epoch
    router.handle(generate("s", max_tokens=None, model="a", prompt="x"), "host", ctx)
    ((_, rejected),) = ctx.take_sent()
    assert isinstance(rejected, Rejected) and rejected.code == "model_restarting"
    router.handle(gave_up, ENGINE_A, ctx)  # the old epoch again: stale
    assert ctx.dead_letters["stale_engine_event"] == 1
    ready = EngineReady(epoch=3, reuse_path="trim", bytes_per_token=1, context_length=64)
    router.handle(ready, engine_address("a", 3), ctx)
    router.handle(generate("t", max_tokens=None, model="a", prompt="x"), "host", ctx)
    assert [to for to, _ in ctx.take_sent()] == [engine_address("a", 3)]


def test_a_failed_model_refuses_requests_until_loaded_again_and_unloads_at_once(
    ctx: RecordingContext,
) -> None:
    router = RouterCore(idle_engine, RestartPolicy(max_restarts=0))
    spec = ModelSpec(name="a", backend="simulated")
    router.handle(LoadModel(spec=spec), "host:load", ctx)
    router.handle(EngineReady(epoch=1, reuse_path="trim", bytes_per_token=1, context_length=64),
                  ENGINE_A, ctx)  # fmt: skip
    router.handle(EngineFailed(epoch=1, code="engine_crashed", message="bug"), ENGINE_A, ctx)
    ctx.take_sent()
    assert router.statistics().gauges["models_failed"] == 1
    router.handle(generate("r", max_tokens=None, model="a", prompt="x"), "host", ctx)
    ((_, rejected),) = ctx.take_sent()
    assert isinstance(rejected, Rejected) and rejected.code == "model_failed"
    assert "(last: bug)" in rejected.message and "load_model" in rejected.message
    router.handle(UnloadModel(model="a"), "host:unload", ctx)
    assert ctx.take_sent() == [("host:unload", ModelUnloaded(model="a", epoch=1))]
    router.handle(LoadModel(spec=spec), "host:load", ctx)
    assert ctx.spawned[-1][0] == engine_address("a", 2)
