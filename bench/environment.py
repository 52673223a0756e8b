"""The run's environment: the first line of a bench's JSON, so a result says where it came from."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from runtime.blas import blas_in_use as runtime_blas_in_use

PACKAGES = ("mlx", "mlx-lm", "msgspec", "uvloop", "anyio")
REPO = Path(__file__).resolve().parents[1]


def describe(mode: str) -> dict[str, Any]:
    """The machine, OS, versions, commit, BLAS in use, ``mode`` (quick or full) and the date."""
    return {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": _memory_gib(),
        },
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in PACKAGES},
        "commit": _commit(),
        "blas": blas_in_use(),
        "mode": mode,
        "argv": sys.argv[1:],
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def blas_in_use() -> str:
    """The BLAS MLX calls in this process: OpenBLAS (preloaded by the Makefile, or opened by
    ``import runtime``; runtime/blas.py) or MLX's own. A BLAS mapped for another library (numpy
    bundles an OpenBLAS) is not the one MLX calls, and is not counted."""
    return runtime_blas_in_use()


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError, AttributeError):  # not every OS names these
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """HEAD, with ``-dirty`` when tracked files differ from it (the numbers are then not its)."""
    try:
        head = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip()
