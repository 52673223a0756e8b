"""Model servers as subprocesses on 127.0.0.1: ``mlx_lm.server``, our ``mlxrt serve`` and
llama.cpp's ``llama-server`` (its command: bench/llama.py).

One launcher for all, so they start alike: a free port, no hub access, output to a temporary log
(quoted when start-up fails), ready once ``GET /health`` answers 200, stopped with SIGTERM (then
SIGKILL) on the way out. Each runs with its default settings, as a person starting it by hand
would; ``mlx_lm.server`` therefore prefills in steps of 2,048 tokens (``--prefill-step-size``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.http_client import HOST, Server

READY_TIMEOUT_S = 120.0  # a real model loads in seconds, but the CPU is shared
STOP_TIMEOUT_S = 10.0


class ServerUnavailable(RuntimeError):
    """The server could not be started or did not become ready (the message says why)."""


@dataclass(frozen=True)
class ServerCommand:
    """How to start one server: its system name, its argv without host and port, and the name
    requests give in ``model``."""

    system: str
    argv: tuple[str, ...]
    model: str


def mlx_lm_server(model_dir: Path) -> ServerCommand:
    """``mlx_lm.server`` serving ``model_dir`` as its default model (requests name it so)."""
    argv = (sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir))
    return ServerCommand("mlx_lm.server", (*argv, "--log-level", "WARNING"), "default_model")


def mlxrt_serve(
    model_path: Path, name: str, backend: str = "mlx", system: str = "runtime"
) -> ServerCommand:
    """``mlxrt serve`` (our runtime behind its OpenAI-compatible API) serving ``model_path`` on
    ``backend`` (its default, MLX, unless named), as bench system ``system``."""
    argv: tuple[str, ...] = (sys.executable, "-m", "runtime.cli", "serve")
    argv += ("--model", f"{name}={model_path}")
    if backend != "mlx":
        argv += ("--backend", backend)
    # Memory only: a disk tier would carry one run's states into the next, so "cold" were not.
    return ServerCommand(
        system, (*argv, "--log-level", "warning", "--quiet", "--no-disk-cache"), name
    )


@contextlib.contextmanager
def running(commands: Sequence[ServerCommand]) -> Iterator[list[Server]]:
    """Start every server at once (their loads overlap), wait until all are ready, yield them in
    the order given; always stop them all."""
    with contextlib.ExitStack() as stack:
        started = [stack.enter_context(_process(command)) for command in commands]
        for process, log, server in started:
            _wait_ready(process, server.port, log)
        yield [server for _, _, server in started]


@contextlib.contextmanager
def _process(command: ServerCommand) -> Iterator[tuple[subprocess.Popen[bytes], IO[str], Server]]:
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [*command.argv, "--host", HOST, "--port", str(port)]
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield process, log, Server(command.system, port, command.model)
        finally:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _wait_ready(process: subprocess.Popen[bytes], port: int, log: IO[str]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read()[-2000:]
            raise ServerUnavailable(f"exited with {process.returncode} before ready: {tail}")
        with contextlib.suppress(OSError, TimeoutError):
            if asyncio.run(_health_status(port)) == 200:
                return
        time.sleep(0.2)
    raise ServerUnavailable(f"no 200 from /health within {READY_TIMEOUT_S:.0f}s")


async def _health_status(port: int) -> int:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 2.0)
    try:
        writer.write(f"GET /health HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 2.0)
        return int(status.split()[1])
    finally:
        writer.close()
