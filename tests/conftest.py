"""Shared fixtures for tests/."""

import importlib.util

import pytest


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
