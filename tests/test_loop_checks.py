"""The event-loop checks of tests/loop_checks.py catch what they are for.

Each test provokes the fault on purpose, asserts that the check wrote it down, and then takes the
finding back so that this test itself passes (any other finding still fails it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from blockbuster import BlockingError

import runtime
from tests import loop_checks

# Code of the runtime's own (its frames' file lies under runtime/): a coroutine a test awaits, as
# the host API is, and a plain function a test calls, as a backend's load is.
_CODE = """
async def sleep_on_the_loop():
    time.sleep(0)

def sleep_in_a_plain_call():
    time.sleep(0)
"""
_RUNTIME_CODE: dict[str, Any] = {"time": time}
exec(compile(_CODE, str(Path(runtime.__file__).parent / "x.py"), "exec"), _RUNTIME_CODE)
sleep_on_the_loop = _RUNTIME_CODE["sleep_on_the_loop"]
sleep_in_a_plain_call = _RUNTIME_CODE["sleep_in_a_plain_call"]


def _take_findings() -> list[str]:
    with loop_checks._found_lock:
        found = list(loop_checks._found)
        loop_checks._found.clear()
    return found


def _take_noted(test: str) -> list[tuple[float, str, str]]:
    """The summary's entries of ``test`` (taken out: they were provoked on purpose)."""
    with loop_checks._found_lock:
        noted = [entry for entry in loop_checks._slowest if entry[1] == test]
        loop_checks._slowest[:] = [entry for entry in loop_checks._slowest if entry[1] != test]
    return noted


pytestmark = pytest.mark.anyio


async def test_the_async_tests_run_in_debug_mode_with_the_threshold() -> None:
    loop = asyncio.get_running_loop()
    assert loop.get_debug()
    assert loop.slow_callback_duration == loop_checks.NOTE_CALLBACK_S < loop_checks.SLOW_CALLBACK_S


async def test_a_blocking_call_on_the_loop_thread_raises_and_is_recorded() -> None:
    with pytest.raises(BlockingError, match=r"time\.sleep"):
        await sleep_on_the_loop()
    assert _take_findings() == ["blocking call on the event loop thread: time.sleep"]


async def test_a_blocking_call_swallowed_by_the_code_still_fails_the_test() -> None:
    with contextlib.suppress(Exception):  # what an actor's crash handler does
        await sleep_on_the_loop()
    assert _take_findings() == ["blocking call on the event loop thread: time.sleep"]


async def test_the_same_call_in_a_worker_thread_is_fine() -> None:
    import anyio.to_thread

    await anyio.to_thread.run_sync(sleep_in_a_plain_call)
    assert _take_findings() == []


async def test_a_test_calling_a_plain_product_function_on_the_loop_is_not_judged() -> None:
    sleep_in_a_plain_call()  # as a test calls MlxBackend.load, which the runtime runs off the loop
    assert _take_findings() == []


async def test_the_tests_own_blocking_setup_is_not_checked() -> None:
    # A test's own code (building a tiny model, say) is not the product: not checked.
    Path(__file__).read_text()  # noqa: ASYNC240
    assert _take_findings() == []


@pytest.mark.parametrize("make_loop", [loop_checks.debug_loop, loop_checks.debug_uvloop])
def test_a_callback_slower_than_the_threshold_is_recorded(
    make_loop: Callable[[], asyncio.AbstractEventLoop], request: pytest.FixtureRequest
) -> None:
    loop = make_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.01  # what is noted: the test then sees the summary's entry

    def hold_the_loop() -> None:  # CPU work, as a blocking call would be
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    def quick() -> None:
        pass

    try:
        loop.call_soon(quick)
        loop.call_soon(hold_the_loop)
        loop.call_soon(loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    [(seconds, _, callback)] = _take_noted(request.node.nodeid)
    assert seconds >= 0.05 and "hold_the_loop" in callback
    assert _take_findings() == []  # noted, not failed: 0.05 s is under SLOW_CALLBACK_S


def test_a_callback_slower_than_the_threshold_fails_the_test(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    monkeypatch.setattr(loop_checks, "SLOW_CALLBACK_S", 0.02)
    monkeypatch.setattr(loop_checks, "overloaded", lambda: False)
    loop = loop_checks.debug_loop()
    loop.set_debug(True)
    loop.slow_callback_duration = 0.01

    def hold_the_loop() -> None:
        end = time.perf_counter() + 0.05
        while time.perf_counter() < end:
            pass

    try:
        loop.call_soon(hold_the_loop)
        loop.call_soon(loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    [found] = _take_findings()
    _take_noted(request.node.nodeid)
    assert found.startswith("slow callback on the event loop: Executing <Handle")
    assert "hold_the_loop" in found
