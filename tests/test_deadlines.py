"""Per-request deadlines and the stall guard (actors/deadlines.py), on the simulator's virtual
clock and on the router's core alone; the host API's and the HTTP server's are at the end of
tests/test_runtime.py and tests/test_http_server.py."""

from __future__ import annotations

import pytest

from actors.router import RouterCore
from runtime.backends.simulated import greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import ROUTER, engine_address
from runtime.messages import (
    Abort,
    Admit,
    Cancelled,
    EngineReady,
    Failed,
    Finished,
    LoadModel,
    Message,
    ModelLoaded,
    ModelSpec,
    RequestDeadline,
    ReusePath,
    SequenceCancelled,
    SequenceStarted,
    StallCheck,
    Started,
    TokensProduced,
    Usage,
)
from runtime.testing.harness import (
    ModelOption,
    engine,
    kv_keeper,
    prefix_cache,
    router,
    sim_spec,
)
from runtime.testing.recording import RecordingContext, idle_engine
from runtime.testing.requests import generate, prewarm
from runtime.testing.simulator import Simulator

PER_TOKEN = 0.001
CHUNK = 16
ENGINE = engine_address("m", 1)


def spec(**options: ModelOption) -> ModelSpec:
    """Model "m": CHUNK-token chunks; every token costs PER_TOKEN of virtual time unless set."""
    costs: dict[str, ModelOption] = {
        "prefill_s_per_token": PER_TOKEN,
        "decode_s_per_token": PER_TOKEN,
    }
    return sim_spec(chunk=CHUNK, **{**costs, **options})


def simulator(
    model: ModelSpec, *, budget: int = 64 << 20, stall_timeout_s: float | None = None
) -> Simulator:
    """A simulator with ``model`` loaded and the runtime's stall guard at ``stall_timeout_s``."""
    config = RuntimeConfig(kv_budget_bytes=budget, stall_timeout_s=stall_timeout_s)
    sim = Simulator(config=config)
    assert isinstance(sim.load(model), ModelLoaded)
    return sim


def run_to_end(sim: Simulator, request_id: str) -> Message:
    """Run until the request's terminal arrives; the clock then reads its arrival time."""
    sim.run_until(lambda: sim.terminal(request_id, 1) is not None)
    terminal = sim.terminal(request_id, 1)
    assert terminal is not None
    return terminal


def assert_failed(terminal: Message, code: str) -> Failed:
    assert isinstance(terminal, Failed), terminal
    assert (terminal.code, terminal.retryable) == (code, True)
    return terminal


def assert_nothing_leaked(sim: Simulator) -> None:
    """At quiescence every reserved byte belongs to a cached prefix entry."""
    sim.run_until_quiescent()
    assert kv_keeper(sim).reserved_bytes == prefix_cache(sim).total_bytes
    assert router(sim).statistics().gauges["expired_awaiting_engine"] == 0


def last_event_is_the_terminal(sim: Simulator, request_id: str) -> None:
    events = sim.events(request_id, 1)
    terminals = [e for e in events if isinstance(e, Finished | Failed)]
    assert terminals == [events[-1]], events


# --------------------------------------------------------------------------- deadlines, by phase


def test_a_deadline_mid_prefill_fails_on_time_and_keeps_what_was_prefilled() -> None:
    sim = simulator(spec())
    prompt = tuple(range(50, 250))  # 200 tokens: 12.5 chunks
    deadline = CHUNK * PER_TOKEN * 3.5  # inside the fourth chunk
    sim.send(generate("a", prompt, timeout_s=deadline))
    failed = assert_failed(run_to_end(sim, "a"), "request_timeout")
    assert sim.clock.now == pytest.approx(deadline)  # at the deadline, not when the engine ends
    assert failed.usage == Usage(prompt_tokens=200, cached_prompt_tokens=0, completion_tokens=0)
    assert "timeout_s of 0.056 s" in failed.message and "before its first token" in failed.message
    assert_nothing_leaked(sim)
    last_event_is_the_terminal(sim, "a")
    # The engine aborted the sequence as a cancel: the chunk running at the deadline finished,
    # and its state was kept, so a retry resumes from it.
    assert engine(sim).counters["cancelled"] == 1
    assert engine(sim).counters["prefilled_tokens"] == 4 * CHUNK
    assert router(sim).counters["events_after_expiry"] == 1  # the engine's SequenceCancelled
    sim.send(generate("b", prompt))
    sim.run_until_quiescent()
    started = next(e for e in sim.events("b", 1) if isinstance(e, Started))
    assert started.cached_tokens == 4 * CHUNK
    assert sim.emitted_tokens("b", 1) == greedy_continuation(prompt, 4)


def test_a_deadline_while_decoding_reports_exactly_the_tokens_shown() -> None:
    sim = simulator(spec())
    prompt = (5, 6, 7, 8)
    sim.send(generate("a", prompt, max_tokens=100, timeout_s=0.0205))
    failed = assert_failed(run_to_end(sim, "a"), "request_timeout")
    shown = sim.emitted_tokens("a", 1)
    assert 0 < len(shown) < 100
    assert shown == greedy_continuation(prompt, 100)[: len(shown)]
    assert failed.usage == Usage(prompt_tokens=4, completion_tokens=len(shown))
    assert f"after {len(shown)} generated tokens" in failed.message
    assert_nothing_leaked(sim)
    last_event_is_the_terminal(sim, "a")


def test_a_deadline_at_the_admission_gate_ends_the_waiting_request_only() -> None:
    sim = simulator(spec(max_concurrent=1))
    sim.send(generate("first", (1, 2, 3), max_tokens=50))  # holds the one slot for about 0.05 s
    sim.send(generate("gated", (4, 5, 6), max_tokens=5, timeout_s=0.01))
    failed = assert_failed(run_to_end(sim, "gated"), "request_timeout")
    assert sim.clock.now == pytest.approx(0.01)
    assert failed.usage == Usage()  # never started: nothing was counted or shown
    assert [type(e) for e in sim.events("gated", 1)] == [Failed]
    assert_nothing_leaked(sim)
    first = sim.terminal("first", 1)
    assert isinstance(first, Finished) and first.usage.completion_tokens == 50


def test_a_deadline_while_queued_for_kv_beats_the_reservation_timeout() -> None:
    model = spec(bytes_per_token=100, decode_s_per_token=0.01)
    sim = simulator(model, budget=10_000)  # reservation_timeout_s: the default 30 s
    sim.send(generate("hog", tuple(range(10)), max_tokens=60))  # 7,000 of 10,000 bytes for 0.6 s
    sim.advance(0.005)
    sim.send(generate("queued", tuple(range(20, 30)), max_tokens=30, timeout_s=0.1))  # 4,000: waits
    sim.advance(0.01)
    assert kv_keeper(sim).statistics().gauges["queued"] == 1
    assert_failed(run_to_end(sim, "queued"), "request_timeout")
    assert sim.clock.now == pytest.approx(0.105)
    sim.run_until_idle()
    assert kv_keeper(sim).statistics().gauges["queued"] == 0  # its reservation left the queue
    assert_nothing_leaked(sim)
    assert isinstance(sim.terminal("hog", 1), Finished)


def test_a_prewarm_with_a_deadline_ends_on_time_and_keeps_its_prefill() -> None:
    sim = simulator(spec())
    prompt = tuple(range(100))
    sim.send(prewarm("w", prompt, timeout_s=0.04))
    assert_failed(run_to_end(sim, "w"), "request_timeout")
    assert_nothing_leaked(sim)
    assert prefix_cache(sim).total_bytes > 0  # the chunks it had done are cached


def test_a_deadline_after_the_request_ended_is_stale_dropped_and_counted() -> None:
    sim = simulator(spec())
    sim.send(generate("a", (1, 2, 3), max_tokens=3, timeout_s=10.0))
    assert isinstance(run_to_end(sim, "a"), Finished)
    sim.run_until_quiescent()  # the deadline timer fires at 10 s, after the end
    assert sim.clock.now >= 10.0  # (the engine's watchdog timer may run the clock further)
    assert router(sim).counters["stale_timers"] == 1
    assert sim.dead_letters["stale_request_timer"] == 1
    last_event_is_the_terminal(sim, "a")


# --------------------------------------------------------------------------- the stall guard


@pytest.mark.parametrize("where", ["request", "runtime"])
def test_a_stream_with_no_token_for_its_stall_timeout_fails_stalled(where: str) -> None:
    per_request = where == "request"
    sim = simulator(spec(decode_s_per_token=1.0), stall_timeout_s=None if per_request else 0.5)
    sim.send(generate("a", (1, 2, 3), max_tokens=5, stall_timeout_s=0.5 if per_request else None))
    sim.run_until(lambda: len(sim.emitted_tokens("a", 1)) == 1)
    first_token_at = sim.clock.now
    failed = assert_failed(run_to_end(sim, "a"), "stream_stalled")
    assert sim.clock.now == pytest.approx(first_token_at + 0.5)
    assert failed.usage == Usage(prompt_tokens=3, completion_tokens=1)
    assert "no token for 0.5 s" in failed.message
    assert_nothing_leaked(sim)
    last_event_is_the_terminal(sim, "a")


def test_a_progressing_stream_and_a_long_prefill_are_never_stalled() -> None:
    # Tokens every 0.3 s against a 0.5 s guard; a 2 s prefill before the first token.
    sim = simulator(spec(prefill_s_per_token=0.01, decode_s_per_token=0.3), stall_timeout_s=0.5)
    sim.send(generate("a", tuple(range(200)), max_tokens=6))
    terminal = run_to_end(sim, "a")
    assert isinstance(terminal, Finished) and terminal.usage.completion_tokens == 6
    assert sim.clock.now > 2.0
    assert router(sim).counters["stall_checks_passed"] >= 2
    assert router(sim).counters["expired_stream_stalled"] == 0


def test_a_request_stream_guard_overrides_the_runtimes() -> None:
    sim = simulator(spec(decode_s_per_token=1.0), stall_timeout_s=0.5)
    sim.send(generate("a", (1, 2, 3), max_tokens=3, stall_timeout_s=5.0))
    assert isinstance(run_to_end(sim, "a"), Finished)


# --------------------------------------------------------------------------- the router alone


@pytest.fixture
def ctx() -> RecordingContext:
    return RecordingContext(ROUTER)


def ready_router(ctx: RecordingContext, stall_timeout_s: float | None = None) -> RouterCore:
    """A router with model "m" ready at epoch 1 and nothing sent yet."""
    core = RouterCore(engine_factory=idle_engine, stall_timeout_s=stall_timeout_s)
    core.handle(LoadModel(spec=ModelSpec(name="m", backend="simulated")), "host:load", ctx)
    ready = EngineReady(epoch=1, reuse_path="trim", bytes_per_token=1, context_length=64)
    core.handle(ready, ENGINE, ctx)
    ctx.take_sent()
    return core


def submit(core: RouterCore, ctx: RecordingContext, **fields: object) -> int:
    request = generate("r", max_tokens=None, prompt="hi", **fields)  # type: ignore[arg-type]
    core.handle(request, "host", ctx)
    [(_, admit)] = ctx.take_sent()
    assert isinstance(admit, Admit)
    return admit.sequence_id


def produced(sequence_id: int, *tokens: int) -> TokensProduced:
    return TokensProduced(sequence_id=sequence_id, epoch=1, token_ids=tokens, text="x")


def fire_due(core: RouterCore, ctx: RecordingContext, at: float) -> None:
    ctx.clock = at
    for timer in ctx.due_timers():
        core.handle(timer, ROUTER, ctx)


def test_the_router_ends_on_the_deadline_and_drops_what_the_engine_says_later(
    ctx: RecordingContext,
) -> None:
    core = ready_router(ctx)
    seq = submit(core, ctx, timeout_s=2.0)
    assert ctx.timers == [(2.0, RequestDeadline(sequence_id=seq))]
    start = SequenceStarted(
        sequence_id=seq, epoch=1, prompt_tokens=5, cached_tokens=2, path=ReusePath.TRIM
    )
    core.handle(start, ENGINE, ctx)
    core.handle(produced(seq, 7, 8), ENGINE, ctx)
    assert len(ctx.take_sent()) == 2
    fire_due(core, ctx, 2.0)
    [(to_engine, abort), (to_host, failed)] = ctx.take_sent()
    assert (to_engine, abort) == (ENGINE, Abort(sequence_id=seq, epoch=1, reason="request_timeout"))
    assert to_host == "host" and isinstance(failed, Failed)
    assert (failed.request_id, failed.code, failed.retryable) == ("r", "request_timeout", True)
    assert failed.usage == Usage(prompt_tokens=5, cached_prompt_tokens=2, completion_tokens=2)
    # A token already on its way and the engine's own terminal are never shown.
    core.handle(produced(seq, 9), ENGINE, ctx)
    cancelled = SequenceCancelled(sequence_id=seq, epoch=1, usage=Usage(), reason="request_timeout")
    core.handle(cancelled, ENGINE, ctx)
    assert ctx.take_sent() == []
    assert core.counters["events_after_expiry"] == 2
    assert core.statistics().gauges["expired_awaiting_engine"] == 0
    assert core.counters["terminal_failed"] == 1
    # Once its engine has let go, anything more about the sequence is an ordinary stale event.
    core.handle(produced(seq, 10), ENGINE, ctx)
    assert core.counters["stale_engine_events"] == 1
    # The request id is free again at once.
    assert submit(core, ctx) == seq + 1


def test_a_stall_check_rearms_while_tokens_come_and_fails_once_they_stop(
    ctx: RecordingContext,
) -> None:
    core = ready_router(ctx, stall_timeout_s=1.0)
    seq = submit(core, ctx)
    assert ctx.timers == []  # the stall clock starts at the first token, not at admission
    ctx.clock = 0.1
    core.handle(produced(seq, 1), ENGINE, ctx)
    ctx.clock = 0.3
    core.handle(produced(seq, 2), ENGINE, ctx)
    ctx.take_sent()
    assert ctx.timers == [(pytest.approx(1.1), StallCheck(sequence_id=seq))]
    fire_due(core, ctx, 1.1)  # a token came at 0.3: the window now ends at 1.3
    assert ctx.take_sent() == []
    assert ctx.timers == [(pytest.approx(1.3), StallCheck(sequence_id=seq))]
    fire_due(core, ctx, 1.3 + 1e-9)
    [(_, abort), (_, failed)] = ctx.take_sent()
    assert abort == Abort(sequence_id=seq, epoch=1, reason="stream_stalled")
    assert isinstance(failed, Failed) and failed.code == "stream_stalled"
    assert failed.usage.completion_tokens == 2
    assert core.counters["stall_checks_passed"] == 1


def test_a_timer_of_an_ended_request_or_from_another_sender_changes_nothing(
    ctx: RecordingContext,
) -> None:
    core = ready_router(ctx)
    seq = submit(core, ctx, timeout_s=2.0)
    core.handle(RequestDeadline(sequence_id=seq), "host", ctx)  # not the router's own timer
    assert ctx.take_sent() == []
    assert ctx.dead_letters["router_unexpected"] == 1
    usage = Usage(prompt_tokens=1)
    core.handle(
        SequenceCancelled(sequence_id=seq, epoch=1, usage=usage, reason="cancelled"), ENGINE, ctx
    )
    [(_, ended)] = ctx.take_sent()
    assert isinstance(ended, Cancelled)
    fire_due(core, ctx, 2.0)  # the request had ended: the deadline is stale
    assert ctx.take_sent() == []
    assert core.counters["stale_timers"] == 1
    assert ctx.dead_letters["stale_request_timer"] == 1
