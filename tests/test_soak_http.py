"""The HTTP soak on the default real model (bench/soak/http_soak.py), at CI size: concurrent
clients, completions and chats, streamed and not, some leaving mid-stream; greedy replies equal
their cold replies, KV returns to the prefix entries, MLX active memory to its baseline.
``make soak`` runs the full-size one (200 requests); docs/reliability.md, "Soak" has its figures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.soak.http_soak import HttpSoakConfig, run_http_soak
from runtime.backends.model_store import DEFAULT_MODEL
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = [pytest.mark.real_model, pytest.mark.anyio]

CI_REQUESTS = 40  # ~22 s with the load and cold replies on the 2-core CPU; make soak runs 200


@pytest.fixture
def anyio_backend() -> LoopBackend:
    # One loop is enough here: the simulated soak runs on both, and a real model is slow.
    return on_uvloop()


async def test_a_short_http_soak_on_the_default_model_leaves_nothing_behind(
    real_gguf: Callable[[str], Path],
) -> None:
    real_gguf(DEFAULT_MODEL)  # fetched (or skipped) as every real-model test does
    report = await run_http_soak(HttpSoakConfig(seed=3, requests=CI_REQUESTS))

    assert report.problems() == []
    tally = report.tally()
    assert sum(tally.values()) == CI_REQUESTS
    assert any(key.endswith("/disconnected") for key in tally), tally
    assert report.engine_counters["cancelled"] > 0  # a disconnect reached the engine
    assert report.engine_counters["batch_steps"] > 0  # concurrent clients shared decode steps
    assert report.prefix_bytes_at_quiescence > 0  # replies were cached until the reset
