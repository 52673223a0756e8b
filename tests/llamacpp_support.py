"""Where the llama.cpp tests may run: skipped without llama-cpp-python, except in CI."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_llama_cpp() -> None:
    """Skip (with one sentence) where llama-cpp-python is not installed; under ``CI``, which
    must run the llama.cpp tests (``make venv`` builds it), fail instead."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail("CI must run the llama.cpp tests: llama-cpp-python is not installed")
    pytest.skip("llama-cpp-python is not installed (pip install 'mlx-actor-runtime[llamacpp]')")
