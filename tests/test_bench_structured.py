"""The structured-output bench group on a tiny model: both arms run and pair (no timing checked)."""

from __future__ import annotations

import pytest

from bench import structured
from runtime.testing.tiny_models import tiny_model_path

pytestmark = pytest.mark.mlx


def test_the_constrained_and_free_arms_pair_up_into_a_ratio() -> None:
    rows = {m.scenario: m for m in structured.measure(tiny_model_path("llama"), "llama", 1)}
    assert set(rows) == {
        "structured.decode_ms_per_token",
        "structured.free_ms_per_token",
        "structured.constrained/free",
    }
    ratio = rows["structured.constrained/free"]
    assert ratio.value is not None and ratio.value > 0 and ratio.unit == "x"
    assert "1 of 1" in ratio.note
