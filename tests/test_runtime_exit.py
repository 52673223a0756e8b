"""Leaving ``async with Runtime(...)``: whatever the shutdown could not do is said in the log."""

from __future__ import annotations

import logging

import pytest

import runtime.host.api
from runtime.errors import ActorStopped
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import ROUTER
from runtime.messages import ModelSpec

pytestmark = pytest.mark.anyio

MODEL = ModelSpec(name="m", backend="simulated")


def shutdown_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "mlx_actor_runtime.api" and r.levelno == logging.WARNING
    ]


async def test_a_shutdown_error_swallowed_on_exit_is_logged_with_its_code_and_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="mlx_actor_runtime.api")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        await rt.load_model(MODEL)
        system = rt._system
        assert system is not None
        system.stop(ROUTER)  # nobody is left to ask for the shutdown: the ask raises ActorStopped
    [warning] = shutdown_warnings(caplog)
    assert ActorStopped.code in warning
    assert "no running actor at 'router'" in warning


async def test_a_shutdown_that_runs_out_of_time_on_exit_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger="mlx_actor_runtime.api")
    monkeypatch.setattr(runtime.host.api, "SHUTDOWN_WAIT_S", 0.0)
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        await rt.load_model(MODEL)
    [warning] = shutdown_warnings(caplog)
    assert "did not finish within 0" in warning


async def test_a_clean_exit_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mlx_actor_runtime.api")
    async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
        await rt.load_model(MODEL)
    assert shutdown_warnings(caplog) == []
