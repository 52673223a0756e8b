"""scripts/run-tests.sh, `make test`'s two pytest runs: which tests each selects, and the exit
status: a failure in either fails, one run selecting nothing is fine, neither selecting is exit 5.

A stand-in "python" records each run's arguments and exits as told, so the script's own logic is
what is tested (the real runs are `make test` itself)."""

from __future__ import annotations

import json
import stat
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "run-tests.sh"

# Exits with $PARALLEL_RC for the run with -n (the first), $ALONE_RC for the other.
FAKE_PYTHON = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["RUNS_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(int(os.environ["PARALLEL_RC" if "-n" in sys.argv else "ALONE_RC"]))
"""


def run_script(tmp_path: Path, codes: tuple[int, int], *args: str) -> tuple[int, list[list[str]]]:
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "runs.jsonl"
    env = {"RUNS_LOG": str(log), "PARALLEL_RC": str(codes[0]), "ALONE_RC": str(codes[1])}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(python), "3", *args],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    return done.returncode, runs


def marker(run: list[str]) -> str:
    """The run's marker expression: the argument after its last ``-m`` (the first is pytest's)."""
    at = len(run) - 1 - run[::-1].index("-m")
    return run[at + 1]


@pytest.mark.parametrize(
    ("codes", "status"),
    [
        ((0, 0), 0),
        ((0, 5), 0),  # e.g. PYTEST_ARGS names a file with no real-model test
        ((5, 0), 0),
        ((5, 5), 5),  # nothing selected at all fails
        ((1, 0), 1),
        ((0, 1), 1),
        ((5, 2), 2),
        ((3, 1), 3),
    ],
)
def test_either_run_failing_fails_and_selecting_nothing_fails_only_when_both_do(
    tmp_path: Path, codes: tuple[int, int], status: int
) -> None:
    returned, runs = run_script(tmp_path, codes, "--hypothesis-profile=ci")
    assert returned == status
    assert len(runs) == 2, "the second run must happen even when the first fails"


def test_the_first_run_is_parallel_without_real_models_the_second_alone_with_them(
    tmp_path: Path,
) -> None:
    _, (parallel, alone) = run_script(tmp_path, (0, 0), "--hypothesis-profile=ci", "-k", "x y")
    assert parallel[:2] == ["-m", "pytest"] and alone[:2] == ["-m", "pytest"]
    assert parallel[parallel.index("-n") + 1] == "3" and "-n" not in alone
    assert marker(parallel) == "not real_model and not cluster"
    assert marker(alone) == "(real_model or cluster)"
    for run in (parallel, alone):
        assert run[-3:] == ["--hypothesis-profile=ci", "-k", "x y"]  # passed on whole


def test_a_marker_expression_in_the_arguments_narrows_both_runs(tmp_path: Path) -> None:
    _, (parallel, alone) = run_script(tmp_path, (0, 0), "-m", "not mlx", "-x")
    assert marker(parallel) == "(not mlx) and not real_model and not cluster"
    assert marker(alone) == "(not mlx) and (real_model or cluster)"
    assert [run.count("-m") for run in (parallel, alone)] == [2, 2]  # `-m pytest` and one more
    assert parallel[-1] == alone[-1] == "-x"
