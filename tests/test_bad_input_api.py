"""The bad-input catalogue through the host API (docs/reliability.md, "The catalogue").

Each case gets its typed error with its stable code and a message naming what to change; no actor
crashes (none logs an error); afterwards nothing is left behind (no live request or sequence, the
KV reserved is what the prefix cache holds) and the same runtime still serves a good request.
The HTTP side is tests/test_bad_input_http.py; files and wire bytes, tests/test_bad_input_files.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from runtime.backends.simulated import greedy_continuation
from runtime.errors import (
    DuplicateRequestId,
    MlxRuntimeError,
    ModelNotLoaded,
)
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    Failed,
    Finished,
    ModelSpec,
    Rejected,
    Sampling,
    UnloadModel,
)
from runtime.testing.harness import (
    ModelOption,
    kv_keeper,
    make_sim,
    router,
    sim_spec,
    wait_until,
)
from runtime.testing.requests import generate

pytestmark = pytest.mark.anyio

CONTEXT = 64
Kwargs = dict[str, Any]


def sim_model(name: str = "m", **options: ModelOption) -> ModelSpec:
    return sim_spec(name, chunk=8, context_length=CONTEXT, **options)


def slow_model(name: str = "m") -> ModelSpec:
    """500 tokens take 2.5 s: a request stays live while the test acts on it."""
    return sim_spec(name, chunk=8, decode_s_per_token=0.005)


def sampling(**fields: object) -> Sampling:
    return Sampling(**fields)  # type: ignore[arg-type]


async def outcome(rt: Runtime, model: str = "m", **kwargs: Any) -> tuple[str, str]:
    """(code, message) of a request that must not succeed, however the runtime refuses it:
    raised at once (validation), raised while iterating (``Rejected``) or a ``Failed`` end."""
    try:
        result = await rt.complete(model, **kwargs)
    except MlxRuntimeError as error:
        return error.code, error.message
    assert isinstance(result.terminal, Failed), f"{kwargs} was not refused: {result}"
    return result.terminal.code, result.terminal.message


async def assert_unharmed(rt: Runtime) -> None:
    """Nothing leaked, no actor crashed, and the runtime still serves a good request."""
    good = await rt.complete("m", "still fine", max_tokens=3)
    assert isinstance(good.terminal, Finished)
    assert good.text == bytes(greedy_continuation(list(b"still fine"), 3)).decode()
    actors = rt.stats().actors
    assert actors["router"].gauges["live_requests"] == 0
    engines = [stats for address, stats in actors.items() if address.startswith("engine")]
    assert all(stats.gauges["sequences"] == 0 for stats in engines)
    assert actors["kv"].gauges["reserved"] == actors["prefix"].gauges["bytes"]
    assert actors["kv"].gauges["queued"] == 0


@pytest.fixture
def no_crash(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if any actor logged an error (a crash is logged before its restart)."""
    caplog.set_level(logging.ERROR, logger="mlx_actor_runtime")
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# (case, request kwargs, code, a word the message must hold: the field or what to change)
REQUEST_CASES: list[tuple[str, Kwargs, str, str]] = [
    ("empty prompt", {"prompt": ""}, "invalid_request", "prompt"),
    ("empty token ids", {"prompt_tokens": []}, "invalid_request", "prompt_tokens"),
    ("negative token id", {"prompt_tokens": [1, -2]}, "invalid_request", "prompt_tokens"),
    ("token id past the vocabulary", {"prompt_tokens": [1, 300]}, "invalid_request", "vocabulary"),
    ("prompt over the context", {"prompt": "x" * 100}, "context_length_exceeded", "shorten"),
    (
        "prompt plus max_tokens over the context",
        {"prompt": "x" * 40, "max_tokens": 40},
        "context_length_exceeded",
        "max_tokens",
    ),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, "invalid_request", "max_tokens"),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -3}, "invalid_request", "max_tokens"),
    ("max_tokens a float", {"prompt": "x", "max_tokens": 2.5}, "invalid_request", "max_tokens"),
    ("max_tokens text", {"prompt": "x", "max_tokens": "8"}, "invalid_request", "max_tokens"),
    ("max_tokens a bool", {"prompt": "x", "max_tokens": True}, "invalid_request", "max_tokens"),
    ("max_tokens huge", {"prompt": "x", "max_tokens": 10**9}, "context_length_exceeded", "(10000"),
    ("max_tokens past int64", {"prompt": "x", "max_tokens": 2**70}, "invalid_request", "leave"),
    *[
        (
            f"{field} {value}",
            {"prompt": "x", "sampling": sampling(**{field: value})},
            "invalid_request",
            field,
        )
        for field, value in [
            ("temperature", math.nan),
            ("temperature", math.inf),
            ("temperature", -0.5),
            ("top_p", 0.0),
            ("top_p", 1.5),
            ("top_p", math.nan),
            ("top_k", -1),
            ("repetition_penalty", math.nan),
            ("presence_penalty", math.nan),
            ("frequency_penalty", math.nan),
            ("dry_multiplier", math.nan),
            ("seed", 2**63),
            ("seed", -(2**63) - 1),
            ("seed", 1.5),
        ]
    ],
    ("empty stop string", {"prompt": "x", "stop": ["ok", ""]}, "invalid_request", "stop"),
    (
        "10,000 stop strings",
        {"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]},
        "invalid_request",
        "at most 16",
    ),
    ("a 2,000-character stop", {"prompt": "x", "stop": ["s" * 2000]}, "invalid_request", "1000"),
    ("negative stop token id", {"prompt": "x", "stop_token_ids": (-1,)}, "invalid_request", "stop"),
    ("unknown model", {"model": "nope", "prompt": "x"}, "model_not_loaded", "load_model"),
]


@pytest.mark.parametrize(
    ("kwargs", "code", "says"), [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES]
)
async def test_a_bad_request_gets_its_code_and_the_runtime_goes_on(
    kwargs: Kwargs, code: str, says: str, no_crash: None
) -> None:
    # Strict: a max_tokens past the room left is refused (by default it is lowered to it:
    # tests/test_http_max_tokens.py).
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20, strict_max_tokens=True)) as rt:
        await rt.load_model(sim_model())
        found, message = await outcome(rt, **kwargs)
        assert found == code
        assert says in message
        await assert_unharmed(rt)


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt_tokens": [7, 999]}, "vocabulary"),
        ({"prompt": "x" * 100}, "context"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ],
    ids=["empty prompt", "token id past the vocabulary", "prompt over the context", "max_tokens 0"],
)
async def test_a_bad_prewarm_is_refused_as_a_generate_is(
    kwargs: Kwargs, says: str, no_crash: None
) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        await rt.load_model(sim_model())
        try:
            ended = await rt.prewarm("m", **kwargs)
        except MlxRuntimeError as error:
            message = error.message
        else:
            assert isinstance(ended, Failed), ended
            message = ended.message
        assert says in message
        await assert_unharmed(rt)


# --------------------------------------------------------------------------- request ids


async def test_a_duplicate_live_request_id_is_refused_and_the_first_runs_on(no_crash: None) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        await rt.load_model(slow_model())
        async with rt.generate("m", "first", max_tokens=500, request_id="r") as first:
            assert not isinstance(await first.__anext__(), Failed)
            with pytest.raises(DuplicateRequestId, match="new id"):
                await rt.complete("m", "second", request_id="r", max_tokens=2)
            # The refused duplicate did not take the id over: a cancel still reaches the first.
            assert await rt.cancel("r")
            ends = [e async for e in first if isinstance(e, Finished | Cancelled | Failed)]
        assert [type(e) for e in ends] == [Cancelled]
        assert not await rt.cancel("r")
        await assert_unharmed(rt)


async def test_cancelling_unknown_finished_or_cancelled_ids_is_a_quiet_no_op(
    no_crash: None,
) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt:
        await rt.load_model(slow_model())
        assert not await rt.cancel("never-sent")
        await rt.complete("m", "done", max_tokens=2, request_id="done")
        assert not await rt.cancel("done")
        async with rt.generate("m", "long", max_tokens=500, request_id="twice") as stream:
            await stream.__anext__()
            assert await rt.cancel("twice")
            await rt.cancel("twice")  # still live until its end arrives: asks again, harmlessly
            ends = [e async for e in stream if isinstance(e, Finished | Cancelled | Failed)]
        assert [type(e) for e in ends] == [Cancelled]  # exactly one end
        assert not await rt.cancel("twice")
        await assert_unharmed(rt)


# --------------------------------------------------------------------------- models


async def test_a_request_for_a_model_being_unloaded_is_refused(no_crash: None) -> None:
    async with (
        Runtime(RuntimeConfig(kv_budget_bytes=64 << 20)) as rt,
        anyio.create_task_group() as tg,
    ):
        await rt.load_model(slow_model("gone"))
        await rt.load_model(sim_model())
        async with rt.generate("gone", "long", max_tokens=500) as in_flight:
            await in_flight.__anext__()
            tg.start_soon(rt.unload_model, "gone")
            await anyio.wait_all_tasks_blocked()  # the unload was sent before the request
            with pytest.raises(ModelNotLoaded, match=r"being unloaded|not loaded"):
                await rt.complete("gone", "x", max_tokens=2)
            ends = [e async for e in in_flight if isinstance(e, Finished | Cancelled | Failed)]
        assert [(type(e), getattr(e, "reason", "")) for e in ends] == [
            (Cancelled, "model_unloaded")
        ]
        await wait_until(rt, lambda: "engine:gone#1" not in rt.stats().actors)
        await assert_unharmed(rt)


def test_the_refusal_during_an_unload_says_so() -> None:
    """On the simulator the order is exact: the request reaches the router right after the
    unload began, while the in-flight request still drains."""
    sim = make_sim(sim_model(decode_s_per_token=0.01))
    sim.send(generate("a", max_tokens=40, prompt="long"))
    sim.advance(0.05)
    sim.send(UnloadModel(model="m"))
    sim.send(generate("b", max_tokens=2, incarnation=2, prompt="x"))
    sim.run_until_quiescent()
    refused = sim.terminal("b", 2)
    assert isinstance(refused, Rejected) and refused.code == "model_not_loaded"
    assert refused.message == "model 'm' is being unloaded; load it again once that ends"
    assert isinstance(sim.terminal("a", 1), Cancelled)
    assert router(sim).live_sequences() == {}
    assert kv_keeper(sim).reserved_bytes == 0


# --------------------------------------------------------------------------- the KV budget


async def test_a_reservation_larger_than_the_budget_is_refused_at_once(no_crash: None) -> None:
    # The queue would wait an hour: being refused at all shows it never queued.
    config = RuntimeConfig(kv_budget_bytes=5_000, reservation_timeout_s=3600.0)
    async with Runtime(config) as rt:
        await rt.load_model(sim_model(bytes_per_token=100))  # 60 tokens: 6,000 bytes
        with anyio.fail_after(10):  # a hang guard, not a timing
            code, message = await outcome(rt, prompt="x" * 50, max_tokens=10)
        assert code == "kv_request_too_large"
        assert "shorten the prompt or lower max_tokens" in message
        assert rt.stats().actors["kv"].counters["queued"] == 0
        await assert_unharmed(rt)


async def test_a_budget_of_zero_refuses_every_request_at_once_saying_why(no_crash: None) -> None:
    async with Runtime(RuntimeConfig(kv_budget_bytes=0, reservation_timeout_s=3600.0)) as rt:
        await rt.load_model(sim_model())
        with anyio.fail_after(10):
            code, message = await outcome(rt, prompt="x", max_tokens=1)
        assert code == "kv_request_too_large"
        assert "(0 bytes)" in message and "kv_budget_bytes" in message
        assert rt.stats().actors["router"].gauges["live_requests"] == 0
        assert rt.stats().actors["kv"].gauges["reserved"] == 0


async def test_a_reservation_that_times_out_names_no_other_request(no_crash: None) -> None:
    config = RuntimeConfig(kv_budget_bytes=10_000, reservation_timeout_s=0.05)
    async with Runtime(config) as rt:
        await rt.load_model(sim_model(bytes_per_token=100, decode_s_per_token=0.1))
        async with rt.generate("m", "y" * 10, max_tokens=50) as hog:  # holds 6,000 bytes
            await hog.__anext__()
            code, message = await outcome(rt, prompt="z" * 10, max_tokens=40)
        assert code == "kv_budget_exhausted"
        assert message == (
            "the request waited 0.05s for 5000 bytes of KV cache and the server is still busy; "
            "retry later, or lower max_tokens."
        )
        await assert_unharmed(rt)
