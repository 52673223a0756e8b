"""The BLAS that MLX calls: OpenBLAS where the machine has it, loaded before MLX is.

MLX's Linux CPU wheel ships a slow reference BLAS: decode is ~2.5x and prefill ~7x slower than with
OpenBLAS. ``libmlx.so`` leaves ``cblas_sgemm`` undefined and the linker looks in the global scope
first, so opening OpenBLAS ``RTLD_GLOBAL`` before ``mlx.core`` is imported does what ``LD_PRELOAD``
does: ``runtime/__init__.py`` calls ``use_fast_blas`` on import. A host that imported MLX first
keeps the slow BLAS and is warned once (``warn_if_slow``). ``MLXRT_BLAS``: unset or ``auto`` finds
OpenBLAS; ``mlx`` keeps MLX's own; a path loads that library.

The linker's rules and the measurements: docs/design.md, "Which BLAS MLX calls".
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

ENV: Final = "MLXRT_BLAS"
INSTALL_HINT: Final = "apt-get install libopenblas0-pthread"

log = logging.getLogger("mlx_actor_runtime.blas")


@dataclass(frozen=True, slots=True)
class BlasStatus:
    """Which BLAS MLX calls in this process, and why.

    ``fast``: OpenBLAS (or, off Linux, the system's own: MLX links Accelerate on macOS).
    ``problem``: when not fast and not chosen with ``MLXRT_BLAS=mlx``, one sentence saying so
    and how to fix it (``warn_if_slow`` logs it once).
    """

    fast: bool
    description: str
    problem: str | None = None


_status: BlasStatus | None = None
_warned = False


def use_fast_blas() -> BlasStatus:
    """Load OpenBLAS for MLX if it is not already mapped and MLX is not yet imported; the
    outcome, decided on the first call (later calls return it)."""
    global _status
    if _status is None:
        _status = _decide()
    return _status


def warn_if_slow() -> None:
    """Log ``use_fast_blas()``'s problem once per process, if it has one (the MLX backend
    calls this as it loads a model, so a simulated-only host hears nothing)."""
    global _warned
    problem = use_fast_blas().problem
    if problem is not None and not _warned:
        _warned = True
        log.warning(problem)


def blas_in_use() -> str:
    """A short description of the BLAS MLX calls here (for load lines and benchmark records)."""
    return use_fast_blas().description


def _decide() -> BlasStatus:
    if sys.platform != "linux":
        return BlasStatus(True, "the system's (MLX links Accelerate on macOS)")
    choice = os.environ.get(ENV, "auto").strip()
    if choice == "mlx":
        return BlasStatus(False, f"MLX built-in (reference BLAS, {ENV}=mlx)")
    path = choice if choice not in ("", "auto") else find_openblas()
    builtin = "MLX built-in (reference BLAS, ~2.5x slower decode and ~7x slower prefill)"
    if path is None or not Path(path).is_file():
        where = f" at {path} ({ENV})" if path else ""
        return BlasStatus(
            False,
            builtin,
            f"BLAS: MLX runs on its slow built-in BLAS (~2.5x slower decode, ~7x slower "
            f"prefill): OpenBLAS was not found{where}; install it: {INSTALL_HINT}",
        )
    if _mapped(path):  # LD_PRELOAD (make), or an earlier load in this process
        how = "LD_PRELOAD" if path_in_preload(path) else "loaded before MLX"
        return BlasStatus(True, f"OpenBLAS via {how} ({path})")
    if "mlx.core" in sys.modules:  # its symbols are bound: loading OpenBLAS now changes nothing
        return BlasStatus(
            False,
            builtin,
            "BLAS: MLX runs on its slow built-in BLAS: mlx was imported before runtime, too late "
            f"to load OpenBLAS for it; import runtime before mlx, or run with LD_PRELOAD={path}",
        )
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as error:
        return BlasStatus(
            False, builtin, f"BLAS: MLX runs on its slow built-in BLAS: {path}: {error}"
        )
    return BlasStatus(True, f"OpenBLAS loaded before MLX ({path})")


def find_openblas() -> str | None:
    """Debian's OpenBLAS ``libblas.so.3`` (pthread, else OpenMP) for this architecture, else a
    ``libopenblas`` the linker knows; None if there is none."""
    machine = platform.machine()
    for variant in ("openblas-pthread", "openblas-openmp"):
        for root in (f"/usr/lib/{machine}-linux-gnu", "/usr/lib"):
            candidate = Path(root) / variant / "libblas.so.3"
            if candidate.is_file():
                return str(candidate)
    found = ctypes.util.find_library("openblas")
    if found is None:
        return None
    for root in (f"/usr/lib/{machine}-linux-gnu", "/usr/lib64", "/usr/lib"):
        if (Path(root) / found).is_file():
            return str(Path(root) / found)
    return None


def path_in_preload(path: str) -> bool:
    """Whether ``LD_PRELOAD`` names ``path`` (or a link to the same file)."""
    real = os.path.realpath(path)
    preload = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    return any(os.path.realpath(entry) == real for entry in preload)


def _mapped(path: str) -> bool:
    maps = Path("/proc/self/maps")
    return maps.exists() and os.path.realpath(path) in maps.read_text()
