"""Faults at every compute point of the llama.cpp backend, on real GGUF models (issue 22).

A fault plan wraps the real backend loader (runtime/testing/faults.py): a scripted raise at
``PREFILL``, ``DECODE`` and ``BATCH_STEP`` on SmolLM2, and at ``SNAPSHOT`` on Gemma 3 (a TRIM
model never snapshots; Gemma 3's sliding window makes every prefill take checkpoints), each with
several streams decoding in one batch and one long prompt cancelled while it prefills; a seeded
random plan (raise, slow) over a burst of generates, prewarms and cancels; a hung decode step the
watchdog gives up on. After each, with faults off, the runtime must be whole: every request ended
exactly once, the KV keeper holds exactly the prefix cache's bytes, every llama.cpp seq_id is free,
held by a live state or queued to be freed (``SeqPool.census``), and a greedy request gives the
tokens of a fault-free run. Found here: a decode batch dropped after a failed step lost its
members' seq_ids, and a context abandoned by the watchdog was never freed.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from runtime.backends.contract import Backend
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.backends.llamacpp.binding import live_contexts
from runtime.backends.loader import make_backend_loader
from runtime.backends.options import ModelOptions
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.host.streams import GenerationStream
from runtime.kernel.core import engine_address, engine_model
from runtime.messages import (
    Cancelled,
    Failed,
    Finished,
    FinishReason,
    ModelLoaded,
    ModelSpec,
    Started,
    TokensEmitted,
)
from runtime.testing.faults import (
    Fault,
    FaultKind,
    FaultPlan,
    FaultPoint,
    Injection,
    without_faults,
)
from runtime.testing.harness import engine_stats, wait_until
from tests.llamacpp_support import require_llama_cpp
from tests.loop_checks import LoopBackend, on_asyncio

pytestmark = [pytest.mark.anyio, pytest.mark.real_model]

SMOL = ModelSpec(
    name="smollm2-135m-instruct",
    path="smollm2-135m-instruct",
    backend="llamacpp",
    options={"n_threads": 1},
)
GEMMA = ModelSpec(
    name="gemma3-270m", path="gemma3-270m", backend="llamacpp", options={"n_threads": 1}
)
CONFIG = RuntimeConfig(kv_budget_bytes=1 << 30)  # nothing is evicted or refused here
TOKENS = 10
SHORT = (
    "The capital of France is",
    "A good recipe for bread starts with",
    "The three primary colours are",
)
LONG = "The keeper climbed the hundred steps of the lighthouse every evening. " * 50
AFTER = "Write one sentence about the sea."
# Cold on both runs: Gemma 3 on llama.cpp can end a near-tie otherwise when a prompt was prefilled
# in other passes (with other prompts, or split), so only the same path is compared.
AFTER_NAMESPACE = "after"
RETRYABLE_STEP_FAILURE = "backend_error"
STEP_TIMEOUT_S = 3.0  # a real step here takes milliseconds; the hung one never ends
WAIT_S = 60  # a safety net for each wait on a busy 2-core machine, not a timing
BOUND_S = 120  # one test, end to end


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    return on_asyncio()  # one loop: every test here loads a real model


@pytest.fixture
def need(real_gguf: Callable[[str], Path]) -> Callable[[ModelSpec], None]:
    """``need(spec)``: skips (or fails under CI) like every real-model test where the model or
    llama-cpp-python is missing."""

    def check(spec: ModelSpec) -> None:
        require_llama_cpp()
        real_gguf(spec.name)

    return check


class Recorded:
    """A plan's loader that remembers, weakly, each llama.cpp backend it made (an abandoned one
    must stay collectable)."""

    def __init__(self, plan: FaultPlan) -> None:
        self._load = plan.wrap_loader(make_backend_loader())
        self.backends: list[weakref.ref[LlamaCppBackend]] = []

    def __call__(self, spec: ModelSpec, options: ModelOptions) -> Backend:
        backend = self._load(spec, options)
        inner = without_faults(backend)
        assert isinstance(inner, LlamaCppBackend)
        self.backends.append(weakref.ref(inner))
        return backend

    def current(self) -> LlamaCppBackend:
        backend = self.backends[-1]()
        assert backend is not None
        return backend


@dataclass
class Outcome:
    """What one request's stream gave: its tokens and every terminal event (one, if sound)."""

    tokens: tuple[int, ...]
    terminals: list[Finished | Cancelled | Failed]

    @property
    def terminal(self) -> Finished | Cancelled | Failed:
        assert len(self.terminals) == 1, self.terminals
        return self.terminals[0]


async def run(
    rt: Runtime,
    model: str,
    prompt: str,
    max_tokens: int = TOKENS,
    *,
    cancel_after: Callable[[], Awaitable[None]] | None = None,
    told: anyio.Event | None = None,
    namespace: str = "default",
) -> Outcome:
    """Generate to the end, reading every event; once it started, cancel it when
    ``cancel_after()`` returns, unless it ended first. ``told`` is set once either happened."""
    tokens: list[int] = []
    terminals: list[Finished | Cancelled | Failed] = []

    async def cancel_later(stream: GenerationStream) -> None:
        assert cancel_after is not None
        await cancel_after()
        stream.cancel()
        if told is not None:
            told.set()

    request = rt.generate(model, prompt, max_tokens=max_tokens, namespace=namespace)
    async with request as stream, anyio.create_task_group() as tg:
        async for event in stream:
            match event:
                case Started() if cancel_after is not None:
                    tg.start_soon(cancel_later, stream)
                case TokensEmitted(token_ids=ids):
                    tokens.extend(ids)
                case Finished() | Cancelled() | Failed():
                    terminals.append(event)
        tg.cancel_scope.cancel()  # it ended before it was cancelled
    if told is not None:
        told.set()
    return Outcome(tuple(tokens), terminals)


_reference: dict[str, tuple[int, ...]] = {}


async def fault_free(spec: ModelSpec) -> tuple[int, ...]:
    """``AFTER``'s greedy tokens on a runtime with no fault plan (once per model)."""
    if spec.name not in _reference:
        async with Runtime(CONFIG) as rt:
            await rt.load_model(spec)
            outcome = await run(rt, spec.name, AFTER, namespace=AFTER_NAMESPACE)
            assert isinstance(outcome.terminal, Finished), outcome.terminal
            _reference[spec.name] = outcome.tokens
    return _reference[spec.name]


def prefilled(rt: Runtime, loaded: ModelLoaded) -> int:
    """Prompt tokens the engine has prefilled so far."""
    return engine_stats(rt, loaded).counters.get("prefilled_tokens", 0)


def settled(rt: Runtime, model: str) -> bool:
    """No sequence is live and the keeper holds only what the prefix cache's entries hold."""
    actors = rt.stats().actors
    live = actors["router"].gauges["live_requests"]
    live += sum(s.gauges["sequences"] for a, s in actors.items() if engine_model(a) == model)
    return live == 0 and actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]


def assert_step_failure(terminal: Finished | Cancelled | Failed) -> None:
    """How a request a fault hit ends: failed, with the stable retryable code of a failed step."""
    assert isinstance(terminal, Failed), terminal
    assert terminal.code == RETRYABLE_STEP_FAILURE and terminal.retryable, terminal


def assert_finished(outcome: Outcome) -> None:
    assert isinstance(outcome.terminal, Finished), outcome.terminal
    assert outcome.terminal.reason is FinishReason.LENGTH and len(outcome.tokens) == TOKENS


async def assert_whole(
    rt: Runtime, recorded: Recorded, spec: ModelSpec, expected: tuple[int, ...]
) -> None:
    """The runtime after the faults: nothing held but cached prefixes, no seq_id lost or handed
    out twice, and a greedy request equal to the fault-free run's (faults must be off)."""
    await wait_until(rt, lambda: settled(rt, spec.name), timeout=WAIT_S)
    after = await run(rt, spec.name, AFTER, namespace=AFTER_NAMESPACE)
    assert isinstance(after.terminal, Finished) and after.tokens == expected
    await wait_until(rt, lambda: settled(rt, spec.name), timeout=WAIT_S)
    # What the faults dropped is unreachable by now (an actor keeps its last message until the
    # next: a failed job's traceback, and the batch in it); states in cycles queue their ids.
    gc.collect()
    backend = recorded.current()
    census = backend.pool.census()
    assert census.sound and census.held, census  # AFTER's cached prefix holds a seq_id
    # What a new state gets holds no cell (nor does any throwaway row of exact_reuse).
    assert all(backend.context.seq_pos_max(seq) == -1 for seq in census.free), census
    assert not any(kind in rt.unrouted_events for kind in ("Finished", "Cancelled", "Failed"))


# ---------------------------------------------------------------------- a raise at each point


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        (SMOL, Fault(FaultPoint.PREFILL, after=1)),
        (SMOL, Fault(FaultPoint.DECODE, after=2)),
        (SMOL, Fault(FaultPoint.BATCH_STEP, after=2)),
        (GEMMA, Fault(FaultPoint.SNAPSHOT)),
    ],
    ids=["prefill", "decode", "batch_step", "snapshot-gemma3"],
)
async def test_a_raise_at_a_compute_point_fails_only_the_requests_it_hit(
    need: Callable[[ModelSpec], None], spec: ModelSpec, fault: Fault
) -> None:
    need(spec)
    expected = await fault_free(spec)
    plan = FaultPlan(fault)
    plan.disable()  # the load computes too: the fault counts the requests' calls only
    recorded = Recorded(plan)
    with anyio.fail_after(BOUND_S):
        async with Runtime(CONFIG, load_backend=recorded) as rt:
            loaded = await rt.load_model(spec)
            plan.enable()
            outcomes: dict[str, Outcome] = {}

            async def one(prompt: str) -> None:
                outcomes[prompt] = await run(rt, spec.name, prompt)

            async def some_prefilled() -> None:
                await wait_until(rt, lambda: prefilled(rt, loaded) > 0, timeout=WAIT_S)

            async def cancelled_while_prefilling(told: anyio.Event) -> None:
                outcomes[LONG] = await run(
                    rt, spec.name, LONG, cancel_after=some_prefilled, told=told
                )

            async with anyio.create_task_group() as tg:
                started = anyio.Event()
                tg.start_soon(cancelled_while_prefilling, started)
                # Cancelled after its first chunk: its next one is in llama_decode, or queued.
                await started.wait()
                for prompt in SHORT:  # decoded together: the batch runs
                    tg.start_soon(one, prompt)
            plan.disable()

            assert plan.injected == [Injection(fault.point, spec.name, FaultKind.RAISE)]
            hit = {p for p, o in outcomes.items() if isinstance(o.terminal, Failed)}
            if not hit:  # it met LONG's chunk after its cancel: Cancelled, and the state dropped
                counters = engine_stats(rt, loaded).counters
                assert counters.get("cancelled_after_failed_step") == 1, outcomes
            for prompt in hit:
                assert_step_failure(outcomes[prompt].terminal)
            cancelled = outcomes[LONG].terminal
            assert LONG in hit or isinstance(cancelled, Cancelled), cancelled
            for prompt in set(SHORT) - hit:
                assert_finished(outcomes[prompt])
            await assert_whole(rt, recorded, spec, expected)


# ---------------------------------------------------------------------- random faults


# SNAPSHOT is left out: SmolLM2 (every layer full attention) never takes a checkpoint.
RANDOM_POINTS = (FaultPoint.PREFILL, FaultPoint.DECODE, FaultPoint.BATCH_STEP)
CANCELLED = ("Count slowly from one to one hundred:", "Name every country in Europe:")
PREWARMED = (
    "You are a careful assistant who answers in one short sentence. " * 8,
    "Context: the keeper's logbook, volume two, entries for the winter. " * 8,
)


# Each of these seeds mixes raises (at two points or more) and slow steps.
@pytest.mark.parametrize("seed", [4, 5, 7])
async def test_random_raises_and_slow_steps_end_every_request_once(
    need: Callable[[ModelSpec], None], seed: int
) -> None:
    need(SMOL)
    expected = await fault_free(SMOL)
    plan = FaultPlan(
        seed=seed,
        rate=0.15,
        points=RANDOM_POINTS,
        kinds=(FaultKind.RAISE, FaultKind.SLOW),
        slow_s=0.05,
    )
    plan.disable()
    recorded = Recorded(plan)
    with anyio.fail_after(BOUND_S):
        async with Runtime(CONFIG, load_backend=recorded) as rt:
            await rt.load_model(SMOL)
            plan.enable()
            generated: dict[str, Outcome] = {}
            prewarmed: dict[str, Finished | Cancelled | Failed] = {}

            async def generate(prompt: str, cancel: bool) -> None:
                at_once = nothing if cancel else None
                generated[prompt] = await run(rt, SMOL.name, prompt, cancel_after=at_once)

            async def prewarm(prompt: str) -> None:
                prewarmed[prompt] = await rt.prewarm(SMOL.name, prompt)

            async with anyio.create_task_group() as tg:
                for prompt in (*SHORT, *CANCELLED):
                    tg.start_soon(generate, prompt, prompt in CANCELLED)
                for prompt in PREWARMED:
                    tg.start_soon(prewarm, prompt)
            plan.disable()

            assert plan.injected  # seeds chosen so that some faults fire
            for prompt in SHORT:
                outcome = generated[prompt]  # exactly one terminal, or this raises
                if isinstance(outcome.terminal, Failed):
                    assert_step_failure(outcome.terminal)
                else:
                    assert_finished(outcome)
            for prompt in CANCELLED:
                terminal = generated[prompt].terminal
                if not isinstance(terminal, Cancelled):
                    assert_step_failure(terminal)
            for terminal in prewarmed.values():
                match terminal:
                    case Finished():  # cached by itself, or taken over by a generate
                        assert terminal.reason in (FinishReason.PREWARMED, FinishReason.ADOPTED)
                    case Cancelled():  # a later request of its (default) session replaced it
                        assert terminal.reason == "superseded", terminal
                    case _:
                        assert_step_failure(terminal)
            await assert_whole(rt, recorded, SMOL, expected)


async def nothing() -> None:
    """Cancel at once (``run``'s ``cancel_after``)."""


# ---------------------------------------------------------------------- a hung step


def model_reloaded(rt: Runtime) -> bool:
    router = rt.stats().actors["router"]
    return router.counters.get("engines_failed") == 1 and router.gauges["models_restarting"] == 0


async def test_a_hung_decode_step_is_abandoned_the_model_reloads_and_its_context_is_freed(
    need: Callable[[ModelSpec], None],
) -> None:
    """The watchdog fails the stuck request (``step_timeout``) and reloads the model; the old
    llama.cpp context stays with the stuck thread (freeing it under a running ``llama_decode``
    would crash) and is freed once that thread lets it go."""
    need(SMOL)
    expected = await fault_free(SMOL)
    plan = FaultPlan(Fault(FaultPoint.DECODE, FaultKind.HANG, after=2))  # after some tokens
    plan.disable()
    recorded = Recorded(plan)
    gc.collect()  # a context left unreachable before this test must not be freed during it
    before = live_contexts()
    config = RuntimeConfig(kv_budget_bytes=CONFIG.kv_budget_bytes, step_timeout_s=STEP_TIMEOUT_S)
    try:
        with anyio.fail_after(BOUND_S):
            async with Runtime(config, load_backend=recorded) as rt:
                first = await rt.load_model(SMOL)
                plan.enable()
                stuck = await run(rt, SMOL.name, SHORT[0])
                assert isinstance(stuck.terminal, Failed), stuck.terminal
                assert stuck.terminal.code == "step_timeout" and stuck.terminal.retryable
                # The first token, then a decode block (Backend.decode_block) that hung inside:
                # the tokens it read before the hang are never shown.
                assert len(stuck.tokens) == 1
                await wait_until(rt, lambda: model_reloaded(rt), timeout=WAIT_S)
                assert len(recorded.backends) == 2
                assert live_contexts() == before + 2  # the old one is the stuck thread's
                plan.disable()

                plan.release_hangs()  # its step raises; its thread ends; the old context goes
                address = engine_address(SMOL.name, first.epoch)
                for thread in threading.enumerate():
                    if thread.name.startswith(address):
                        await anyio.to_thread.run_sync(thread.join, WAIT_S)
                await anyio.lowlevel.checkpoint()  # the thread's last callback, on the loop
                gc.collect()
                assert recorded.backends[0]() is None
                assert live_contexts() == before + 1

                await assert_whole(rt, recorded, SMOL, expected)
        assert live_contexts() == before
    finally:
        plan.release_hangs()
