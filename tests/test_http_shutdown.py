"""Stopping a real ``mlxrt serve`` process (SIGINT as Ctrl-C sends it, SIGTERM as ``kill`` does):
exit 0 with one line and no traceback; an open stream ends with a last chunk carrying
``finish_reason`` "abort" and the ``server_shutting_down`` error, then ``[DONE]``; a request not
answered yet gets a typed 503. Each wait is bounded; the process is always killed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.http_client import HOST
from tests.test_serve_process import wait_for

SLOW_DECODE = "decode_s_per_token=0.05"  # a 2,000-token stream outlives every test here
STOPPED_WITHIN_S = 8.0  # below uvicorn's 10 s graceful timeout: nothing waits for it
READY_WITHIN_S = 60.0


class Served:
    def __init__(self, process: subprocess.Popen[str], url: str) -> None:
        self.process = process
        self.url = url

    def stop(self, sig: signal.Signals) -> tuple[int, str]:
        """Send ``sig`` and wait (bounded) for the exit; its return code and its output."""
        self.process.send_signal(sig)
        output, _ = self.process.communicate(timeout=STOPPED_WITHIN_S)
        return self.process.returncode, output


@contextlib.contextmanager
def mlxrt_serve(*args: str) -> Iterator[Served]:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    argv = [sys.executable, "-m", "runtime.cli", "serve", "--quiet", "--no-disk-cache"]
    argv += ["--backend", "simulated"]
    argv += ["--model", "m", "--model-option", SLOW_DECODE, *args, "--port", str(port)]
    # Ctrl-C's SIGINT must reach Python as KeyboardInterrupt would (not ignored, as a background
    # job's is): the child starts with the default handler.
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        url = f"http://{HOST}:{port}"
        _wait_ready(process, url)
        yield Served(process, url)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=STOPPED_WITHIN_S)


def _wait_ready(process: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "mlxrt serve exited before it was ready"
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.1)  # polling another process: there is nothing to wait on
    pytest.fail(f"mlxrt serve was not ready within {READY_WITHIN_S} s")


def _assert_clean_exit(returncode: int, output: str, sig: signal.Signals, note: str = "") -> None:
    assert "Traceback" not in output and "Exception in ASGI" not in output, output
    assert returncode == 0, output
    assert output.rstrip().splitlines()[-1] == f"mlxrt serve: stopped ({sig.name}{note})"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_idle_server_stops_with_exit_0_and_one_line(sig: signal.Signals) -> None:
    with mlxrt_serve() as served:
        returncode, output = served.stop(sig)
    _assert_clean_exit(returncode, output, sig)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_an_open_stream_gets_its_last_chunk_and_done_then_exit_0(endpoint: str) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 2000, "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hello"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "hello"
        path = "/v1/completions"
    with mlxrt_serve() as served, httpx.Client(timeout=30.0) as client:
        with client.stream("POST", f"{served.url}{path}", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"]  # the stream is running
            started = time.monotonic()
            served.process.send_signal(signal.SIGINT)
            rest = [line for line in lines if line.startswith("data: ")]
        returncode, output = _wait(served)
    assert time.monotonic() - started < STOPPED_WITHIN_S
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "abort"
    assert last["error"]["code"] == "server_shutting_down"
    assert last["error"]["type"] == "server_error"
    _assert_clean_exit(returncode, output, signal.SIGINT, ", 1 open request ended")


def test_a_request_not_answered_yet_gets_a_typed_503() -> None:
    body = {"model": "m", "prompt": "hello", "max_tokens": 2000}
    answers: list[httpx.Response] = []
    with mlxrt_serve() as served:

        def ask() -> None:
            answers.append(httpx.post(f"{served.url}/v1/completions", json=body, timeout=30.0))

        asking = threading.Thread(target=ask)
        asking.start()
        _wait_live(served.url)
        served.process.send_signal(signal.SIGTERM)
        asking.join(timeout=STOPPED_WITHIN_S)
        returncode, output = _wait(served)
    [answer] = answers
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "server_shutting_down"
    assert answer.headers["retry-after"] == "1"
    _assert_clean_exit(returncode, output, signal.SIGTERM, ", 1 open request ended")


def _wait(served: Served) -> tuple[int, str]:
    output, _ = served.process.communicate(timeout=STOPPED_WITHIN_S)
    return served.process.returncode, output


def _wait_live(url: str) -> None:
    """Until the server runs one request (another process: polled, bounded)."""

    def live() -> bool:
        cards = httpx.get(f"{url}/v1/models", timeout=2.0).json()["data"]
        return any(card["live_requests"] for card in cards)

    wait_for(live, "the request to go live", READY_WITHIN_S)
