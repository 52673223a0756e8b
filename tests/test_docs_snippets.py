"""The quick start in docs/api.md and README's embedding block run as written: every ```python
block preceded by the line ``<!-- runnable -->`` runs in a fresh interpreter, on the tiny llama
model (the block's ``default_model_spec()`` replaced by the tiny model's spec, the one
substitution made) and, under ``real_model``, exactly as written on the default model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.testing.tiny_models import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent
API_DOC = ROOT / "docs" / "api.md"
README = ROOT / "README.md"
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
DEFAULT_MODEL_CALL = "default_model_spec()"


def runnable_blocks(doc: Path = API_DOC) -> list[str]:
    return RUNNABLE.findall(doc.read_text())


def on_tiny_model(block: str) -> str:
    """The block with the default model replaced by the tiny llama model."""
    assert DEFAULT_MODEL_CALL in block, "a runnable block loads the default model"
    tiny = f"ModelSpec(name='tiny', path={str(tiny_model_path('llama'))!r})"
    return "from runtime import ModelSpec\n" + block.replace(DEFAULT_MODEL_CALL, tiny)


def run_block(source: str) -> str:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, f"{source}\nexited {done.returncode}:\n{done.stderr}"
    return done.stdout


def test_the_quick_start_has_its_runnable_blocks() -> None:
    blocks = runnable_blocks()
    assert len(blocks) == 2 and all("anyio.run(main)" in block for block in blocks)


@pytest.mark.parametrize("index", [0, 1], ids=["chat", "autocomplete"])
def test_each_runnable_block_runs_on_the_tiny_model(index: int) -> None:
    output = run_block(on_tiny_model(runnable_blocks()[index]))
    if index == 0:
        assert int(re.search(r"reused (\d+) of", output)[1]) > 0  # type: ignore[index]
    else:
        assert "generates_superseded" in output and "suggestion" in output


@pytest.mark.real_model
@pytest.mark.parametrize("index", [0, 1], ids=["chat", "autocomplete"])
def test_each_runnable_block_runs_as_written_on_the_default_model(
    index: int, real_gguf: Callable[[str], Path]
) -> None:
    real_gguf("smollm2-135m-instruct")  # skips as the other real-model tests do
    output = run_block(runnable_blocks()[index])
    if index == 0:
        assert "Paris" in output and int(re.search(r"reused (\d+) of", output)[1]) > 0  # type: ignore[index]


def test_the_readme_s_embedding_block_runs_as_a_file(tmp_path: Path) -> None:
    """issue 21: it was a fragment (a top-level ``async with``) that no file could run."""
    [block] = runnable_blocks(README)
    app = tmp_path / "app.py"
    app.write_text(on_tiny_model(block))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, str(app)], capture_output=True, text=True, timeout=100, check=False,
        env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()  # the reply's text, streamed


@pytest.mark.real_model
def test_the_readme_s_embedding_block_runs_as_written_on_the_default_model(
    real_gguf: Callable[[str], Path],
) -> None:
    real_gguf("smollm2-135m-instruct")  # skips as the other real-model tests do
    [block] = runnable_blocks(README)
    assert "Paris" in run_block(block)
