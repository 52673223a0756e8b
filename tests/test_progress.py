"""The CLI's progress bars (runtime/progress.py)."""

from __future__ import annotations

import pytest

from runtime.progress import tqdm_progress


def test_a_bar_closes_when_its_stage_ends_not_when_the_context_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """issue 21: `serve` keeps one progress context for its whole life, so a reload's bar stayed
    open until exit ("59.0s/it" for a 2.5 s load). A stage that reports done == total is over."""
    with tqdm_progress() as progress:
        progress("load m", 0, 1)
        assert not capsys.readouterr().err.endswith("\n")  # drawn, still open
        progress("load m", 1, 1)
        assert capsys.readouterr().err.endswith("\n")  # closed: the line is finished
        progress("load m", 0, 1)  # a reload of the same model: a bar of its own
        progress("load m", 1, 1)
        again = capsys.readouterr().err
        assert "load m: 100%" in again and again.endswith("\n")
