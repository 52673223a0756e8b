"""What a machine can load by name (``available_models``), the keep-alive parser, and
``mlxrt models``: on a cache directory the test builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.backends.model_source import available_models
from runtime.backends.model_store import KNOWN_MODELS, model_cache_path
from runtime.cli import main
from runtime.server.models import parse_keep_alive

SMOL = KNOWN_MODELS["smollm2-135m-instruct"]
GEMMA = KNOWN_MODELS["gemma3-270m"]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path))
    return tmp_path


def by_name() -> dict[str, tuple[str, str, str]]:
    return {m.name: (m.source, m.cache, m.path) for m in available_models()}


def test_an_empty_cache_offers_the_known_models_not_fetched(cache: Path) -> None:
    assert by_name() == {
        name: ("known", "not_fetched", name) for name in ("smollm2-135m-instruct", "gemma3-270m")
    }


def test_cache_states_and_other_conversions_are_read_from_the_directories(cache: Path) -> None:
    converted = cache / "converted"
    (converted / f"{SMOL.sha256[:16]}-float32-v1").mkdir(parents=True)
    (converted / "0123456789abcdef-bfloat16-v1").mkdir()  # a conversion of some other GGUF file
    (converted / ".0123456789abcdef-float32-v1.tmp").mkdir()  # one still being built
    gguf = model_cache_path(GEMMA)
    gguf.parent.mkdir(parents=True)
    with gguf.open("wb") as file:
        file.truncate(GEMMA.size)  # sparse: only its size is checked
    other = str(converted / "0123456789abcdef-bfloat16-v1")
    assert by_name() == {
        "smollm2-135m-instruct": ("known", "converted", "smollm2-135m-instruct"),
        "gemma3-270m": ("known", "downloaded", "gemma3-270m"),
        "0123456789abcdef-bfloat16-v1": ("converted", "converted", other),
    }


def test_mlxrt_models_lists_them(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (cache / "converted" / f"{GEMMA.sha256[:16]}-quantized-v1").mkdir(parents=True)
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SOURCE", "CACHE", "DESCRIPTION"]
    assert lines[1].split()[:4] == ["smollm2-135m-instruct", "known", "not", "fetched"]
    assert lines[2].split()[:3] == ["gemma3-270m", "known", "converted"]


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(300, 300.0), (0, 0.0), (-1, None), ("-1", None), ("90s", 90.0), ("5m", 300.0),
     ("1.5h", 5400.0), ("250ms", 0.25), (" 2 m ", 120.0)],
)  # fmt: skip
def test_keep_alive_accepts_seconds_and_durations(
    given: float | str, seconds: float | None
) -> None:
    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("given", ["soon", "5 minutes", "1d", "", float("nan"), float("inf")])
def test_keep_alive_refuses_anything_else_with_a_sentence(given: float | str) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(given)
