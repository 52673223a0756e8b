"""Run a test's script in a fresh interpreter that imports this checkout: for what a process does
once (start Ray, set its own niceness) and a test's own process must not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from runtime.testing.tiny_models import tiny_model_path

ROOT = Path(__file__).resolve().parent.parent


def run_script(script: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """``script`` with ``PATH`` replaced by the tiny llama's directory, run from the repository
    root; its output comes back as text, whatever its exit code."""
    source = script.replace("PATH", repr(str(tiny_model_path("llama"))))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-c", source],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
