"""The "never block the event loop" rule, checked on every test (issue 24).

Two detectors, active for the whole session and judged after each test phase:

* **Slow callbacks.** The async tests run their loops in asyncio debug mode (tests/conftest.py's
  ``anyio_backend``, on plain asyncio and on uvloop, which logs slow callbacks the same way) with
  ``slow_callback_duration = SLOW_CALLBACK_S``; debug mode then logs "Executing <Handle> took X
  seconds" for any callback or task step that held the loop longer. A handler on the ``asyncio``
  logger collects those lines, and the phase in which one was logged fails with them.
* **Blocking calls.** ``blockbuster`` (a library made for this job) patches time.sleep, file and
  socket I/O, os calls and lock waits to raise ``BlockingError`` when called on a thread running an
  event loop from runtime/ or actors/ code (not from runtime/testing/ or the tests' own setup).
  The runtime's actors may catch that error and turn it into a typed failure, so every raise is
  also recorded and fails the phase itself.

The threshold and why, the allow-list and the numbers measured: docs/design.md, "Checking the loop".
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import sys
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from blockbuster import BlockBuster, blockbuster

# The whole suite's slowest callback on a loaded 2-core machine was well under this, while one
# genuinely blocking call (a model load, a disk write, a sleep on the loop) runs for longer: see
# docs/design.md, "Checking the loop". MLXRT_SLOW_CALLBACK_S overrides it (e.g. to measure).
SLOW_CALLBACK_S = float(os.environ.get("MLXRT_SLOW_CALLBACK_S", "1.0"))
# Callbacks past this are logged by debug mode and listed at the end of the run (the slowest
# first), without failing: the margin under the threshold, seen on every run.
NOTE_CALLBACK_S = SLOW_CALLBACK_S / 5
# Blocking calls are looked for in the product: a call that runtime/ or actors/ code makes on the
# loop thread. The tests' own setup (building a tiny model in an async test) and the test support
# in runtime/testing/ may do file I/O on the loop: they are not what a host runs.
ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("runtime", "actors")
NOT_SCANNED = ("runtime.testing",)

_TEST_TASK = "TestRunner._run_tests_and_fixtures"  # anyio's pytest plugin's task
_current = ""  # the test whose phase runs now, for the summary
_slowest: list[tuple[float, str, str]] = []  # (seconds, test, callback), one run's notes
_found: list[str] = []
_found_lock = threading.Lock()


def debug_loop() -> asyncio.AbstractEventLoop:
    """A plain asyncio loop that logs callbacks slower than ``SLOW_CALLBACK_S`` (debug mode)."""
    loop = asyncio.new_event_loop()
    loop.slow_callback_duration = NOTE_CALLBACK_S
    return loop


def debug_uvloop() -> asyncio.AbstractEventLoop:
    """The same on uvloop (what `mlxrt serve` and the CLI run on)."""
    import uvloop

    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    loop.slow_callback_duration = NOTE_CALLBACK_S
    return loop


# The two ``anyio_backend`` values every async test runs on (tests/conftest.py), and that a module
# running on one loop only returns from its own ``anyio_backend`` fixture.
LoopBackend = tuple[str, dict[str, object]]


def on_asyncio() -> LoopBackend:
    return ("asyncio", {"debug": True, "loop_factory": debug_loop})


def on_uvloop() -> LoopBackend:
    return ("asyncio", {"debug": True, "loop_factory": debug_uvloop})


def overloaded() -> bool:
    """Whether the machine runs more than twice as many tasks as it has cores (the 1-minute load
    average): there a callback's wall-clock time measures the scheduler more than the callback
    (a thread start on the loop waited a second for the OS, niced, at a load of 10 on 2 cores),
    so a slow callback is noted, not failed. CI and an ordinary run are judged."""
    return os.getloadavg()[0] > 2 * (os.cpu_count() or 1)


class _SlowCallbacks(logging.Handler):
    """Collects debug mode's "Executing <handle> took X seconds" (asyncio's and uvloop's)."""

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args
        if not (isinstance(record.msg, str) and record.msg.startswith("Executing")):
            return
        if not (isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], float)):
            return
        seconds, callback = args[1], str(args[0])[:300]
        # The test's own task (its body, and what it awaits) may run a slow setup step on the
        # loop, such as loading a model with a plain call: noted, not failed. Actors, timers and
        # the server's request tasks each run in tasks of their own, and are judged.
        own_task = _TEST_TASK in callback
        with _found_lock:
            _slowest.append((seconds, _current, callback))
            if seconds > SLOW_CALLBACK_S and not own_task and not overloaded():
                _found.append(f"slow callback on the event loop: {record.getMessage()[:400]}")


class _RecordedBlockingError(blockbuster.BlockingError):
    """blockbuster's error, also written down where it is raised (actors may swallow it)."""

    def __init__(self, func: str) -> None:
        super().__init__(func)
        with _found_lock:
            _found.append(f"blocking call on the event loop thread: {func}")


_PRODUCT = tuple(str(ROOT / name) + os.sep for name in SCANNED)
_TEST_SUPPORT = str(ROOT / "runtime" / "testing") + os.sep
_TESTS = tuple(str(ROOT / name) + os.sep for name in ("tests", "property_tests"))


def _a_test_calls_a_sync_api() -> bool:
    """Whether the product code on the stack was entered by a test calling a plain (not async)
    function of it: ``MlxBackend.load(spec)`` in a test body, say, which the runtime itself only
    ever runs on a compute thread. That is the test's own blocking, not the product's. A test
    awaiting the host API (a coroutine) is the product on the loop, and stays checked."""
    frame = sys._getframe(2)
    outermost = None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_PRODUCT) and not name.startswith(_TEST_SUPPORT):
            outermost = frame
        frame = frame.f_back
    if outermost is None or outermost.f_back is None:
        return False
    called_from_a_test = outermost.f_back.f_code.co_filename.startswith(_TESTS)
    return called_from_a_test and not outermost.f_code.co_flags & inspect.CO_COROUTINE


def _allow_deliberate_blocking(buster: BlockBuster) -> None:
    """Blocking calls on the loop thread that are allowed, each with its reason."""
    # Log records written to stderr or a log file: asyncio itself logs on its loop thread, and a
    # log line is one short buffered write (a handler that must not block is the host's choice).
    for name in ("io.TextIOWrapper.write", "io.BufferedWriter.write"):
        buster.functions[name].can_block_in("logging/__init__.py", {"emit", "flush"})
    for function in buster.functions.values():
        allowed = function.can_block_predicate

        def predicate(*args: Any, _allowed: Any = allowed, **kwargs: Any) -> bool:
            return bool(_allowed(*args, **kwargs)) or _a_test_calls_a_sync_api()

        function.can_block_predicate = predicate


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger("asyncio").addHandler(_SlowCallbacks(level=logging.WARNING))
    # The wrapper raises the module's BlockingError by name at call time: the recording subclass
    # takes its place (and is still a BlockingError for anything that catches it).
    blockbuster.BlockingError = _RecordedBlockingError  # type: ignore[misc]
    buster = BlockBuster(scanned_modules=list(SCANNED), excluded_modules=list(NOT_SCANNED))
    _allow_deliberate_blocking(buster)
    buster.activate()
    config.stash[_BUSTER] = buster


def pytest_unconfigure(config: pytest.Config) -> None:
    buster = config.stash.get(_BUSTER, None)
    if buster is not None:
        buster.deactivate()


_BUSTER = pytest.StashKey[BlockBuster]()


def _judge(phase: str | None) -> None:
    with _found_lock:
        found = list(_found)
        _found.clear()
    if found and phase is not None:
        lines = "\n".join(f"  {line}" for line in found[:10])
        pytest.fail(f"the event loop was blocked during {phase}:\n{lines}", pytrace=False)


def _judged(phase: str) -> Generator[None, Any, Any]:
    """Run a test phase's hooks (the ``yield``), then judge what the loop did during it."""
    try:
        result = yield
    except BaseException:
        _judge(None)  # failed already: clear, so the next phase is judged on its own
        raise
    _judge(phase)
    return result


_last_file: Path | None = None


def _freeze_what_earlier_files_left(item: pytest.Item) -> None:
    """At each test file's first test, collect the garbage the files before it left and freeze
    the survivors (imports, session fixtures, caches) out of the cyclic collector's sight.

    Any thread's collection holds the GIL while it scans every tracked object, so the loop
    stalls for as long as the heap takes: in one process that has run 4,000 tests it is the
    suite's heap, not the product's, and a collection during a late test took over a second
    on a slow CPU (CI, 2026-11-28). Frozen, the scans cover what the current file made. Done
    here, between files and off any event loop; objects still alive now and made garbage by
    a cycle later are not reclaimed, which a test process can afford."""
    global _last_file
    if item.path != _last_file:
        _last_file = item.path
        gc.collect()
        gc.freeze()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, Any]:
    global _current
    _current = item.nodeid
    _freeze_what_earlier_files_left(item)
    return (yield from _judged("setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _judged("the test"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    return (yield from _judged("teardown"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _slowest:
        return
    note = " (overloaded now: not failed)" if overloaded() else ""
    terminalreporter.section(
        f"loop callbacks over {NOTE_CALLBACK_S:.2f} s (a test fails over {SLOW_CALLBACK_S:.2f} s)"
        + note
    )
    for seconds, test, callback in sorted(_slowest, reverse=True)[:15]:
        terminalreporter.write_line(f"{seconds:7.3f} s  {test}  {callback[:120]}")
