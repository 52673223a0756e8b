"""Every entry point runs MLX on OpenBLAS where the machine has it, with no LD_PRELOAD, and says
once, with the fix, where it does not (runtime/blas.py). Checked in fresh processes: the dynamic
linker's own record (``LD_DEBUG=bindings``) says which library ``cblas_sgemm`` bound to."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from runtime.blas import ENV, find_openblas
from runtime.testing.tiny_models import tiny_model_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
OPENBLAS = find_openblas()
needs_openblas = pytest.mark.skipif(
    sys.platform != "linux" or OPENBLAS is None, reason="no OpenBLAS on this machine"
)
MATMUL = "import mlx.core as mx; a = mx.ones((64, 64)); mx.eval(a @ a)"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", ENV)}
    return {**env, "TRANSFORMERS_VERBOSITY": "error", **extra}


def _run(args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=_env(**extra), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip


def _sgemm_bindings(tmp_path: pathlib.Path) -> list[str]:
    """The libraries ``cblas_sgemm`` was bound to, from the LD_DEBUG files of the process."""
    found = []
    for log in tmp_path.glob("ld.*"):
        for line in log.read_text(errors="replace").splitlines():
            if "libmlx" in line and "`cblas_sgemm'" in line:
                found.append(line.split(" to ", 1)[1].split(" [")[0])
    return found


@needs_openblas
def test_a_host_that_imports_runtime_first_gets_openblas(tmp_path: pathlib.Path) -> None:
    done = _run(
        ["-c", f"import runtime\n{MATMUL}"],
        LD_DEBUG="bindings",
        LD_DEBUG_OUTPUT=str(tmp_path / "ld"),
    )
    assert done.returncode == 0, done.stderr
    assert OPENBLAS is not None
    assert _sgemm_bindings(tmp_path) == [OPENBLAS]


@needs_openblas
def test_without_runtime_mlx_binds_its_own_blas(tmp_path: pathlib.Path) -> None:
    """The control: what the test above rules out does happen without the runtime."""
    done = _run(["-c", MATMUL], LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(tmp_path / "ld"))
    assert done.returncode == 0, done.stderr
    [bound] = _sgemm_bindings(tmp_path)
    assert "mlx_cpu.libs" in bound


@needs_openblas
def test_mlxrt_generate_runs_on_openblas(tmp_path: pathlib.Path) -> None:
    model = str(tiny_model_path("llama"))
    args = ["-m", "runtime.cli", "generate", "--model", model, "--max-tokens", "2", "--quiet"]
    done = _run(
        [*args, "--raw", "hello"],
        LD_DEBUG="bindings",
        LD_DEBUG_OUTPUT=str(tmp_path / "ld"),
    )
    assert done.returncode == 0, done.stderr
    assert OPENBLAS is not None
    assert set(_sgemm_bindings(tmp_path)) == {OPENBLAS}
    assert "BLAS" not in done.stderr


@needs_openblas
def test_make_s_preload_is_not_loaded_twice() -> None:
    assert OPENBLAS is not None
    done = _run(["-c", "import runtime.blas as b; print(b.blas_in_use())"], LD_PRELOAD=OPENBLAS)
    assert done.stdout.strip() == f"OpenBLAS via LD_PRELOAD ({OPENBLAS})"


def test_no_openblas_is_said_once_with_the_fix(tmp_path: pathlib.Path) -> None:
    """Two models load; the warning comes once, and names the package to install."""
    model = str(tiny_model_path("llama"))
    script = f"""
import anyio
from runtime import Runtime, ModelSpec

async def main():
    async with Runtime() as rt:
        for name in ("a", "b"):
            await rt.load_model(ModelSpec(name=name, path={model!r}))

anyio.run(main)
"""
    done = _run(["-c", script], **{ENV: str(tmp_path / "no-such-libblas.so")})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("slow built-in BLAS") == 1, done.stderr
    assert "apt-get install libopenblas0-pthread" in done.stderr


@needs_openblas
def test_a_host_that_imported_mlx_first_is_told_the_fix() -> None:
    model = str(tiny_model_path("llama"))
    script = f"""
import mlx.core
import anyio
from runtime import Runtime, ModelSpec

async def main():
    async with Runtime() as rt:
        await rt.load_model(ModelSpec(name="a", path={model!r}))

anyio.run(main)
"""
    done = _run(["-c", script])
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("slow built-in BLAS") == 1, done.stderr
    assert "import runtime before mlx" in done.stderr


def test_mlx_s_own_blas_on_request_is_no_warning() -> None:
    done = _run(["-c", "import runtime.blas as b; print(b.use_fast_blas())"], **{ENV: "mlx"})
    assert "problem=None" in done.stdout and "fast=False" in done.stdout
