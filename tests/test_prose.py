"""Prose and size rules a reader relies on, checked on the source (docs/design.md, "Principles").

A module docstring says why in about ten lines and points to the design doc for the rest; a module
has one job and stays under ~400 lines. Both fail here, naming the file, when a change breaks them.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_DOCSTRING_LINES = 10
MAX_MODULE_LINES = 420

# Files other work owned while these rules came in; each is held at what it had then, so it cannot
# grow, until it is brought under the rule (lower a cap, or drop the entry, as it shrinks).
DOCSTRING_CAPS: dict[str, int] = {
    "runtime/backends/llamacpp/backend.py": 11,
    "runtime/backends/llamacpp/binding.py": 11,
    "runtime/backends/llamacpp/passes.py": 11,
    "runtime/backends/llamacpp/persist.py": 11,
    "runtime/backends/llamacpp/seqs.py": 14,
    "runtime/backends/vision/store.py": 12,
    "runtime/cluster/proxy.py": 12,
}


def _modules() -> list[pathlib.Path]:
    return sorted(
        p
        for top in ("runtime", "actors")
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _docstring_lines(path: pathlib.Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    return len(doc.splitlines()) if doc else 0


def test_module_docstrings_are_ten_lines_at_most() -> None:
    too_long = {
        _name(p): n
        for p in _modules()
        if (n := _docstring_lines(p)) > DOCSTRING_CAPS.get(_name(p), MAX_DOCSTRING_LINES)
    }
    assert not too_long, (
        f"module docstrings over {MAX_DOCSTRING_LINES} lines (say why, point to docs/design.md "
        f"for the rest): {too_long}"
    )


def test_docstring_caps_name_real_files() -> None:
    missing = [name for name in DOCSTRING_CAPS if not (ROOT / name).is_file()]
    assert not missing, f"caps for files that no longer exist: {missing}"


@pytest.mark.parametrize("doc", ["Short.", "One.\n\nTwo.\n", "\n".join(["line"] * 11)])
def test_the_docstring_count_counts_lines(doc: str, tmp_path: pathlib.Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(f'"""{doc}"""\n')
    assert _docstring_lines(module) == len(doc.splitlines())


# Over the line, each held at its length when the rule came in so it cannot grow. The first two
# were other branches' work then; the rest are still to be split along a seam.
MODULE_CAPS: dict[str, int] = {
    "runtime/backends/mlx/backend.py": 449,
}


def test_modules_are_420_lines_at_most() -> None:
    too_long = {
        _name(p): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MODULE_CAPS.get(_name(p), MAX_MODULE_LINES)
    }
    assert not too_long, (
        f"modules over {MAX_MODULE_LINES} lines (split along a seam, one job each): {too_long}"
    )


def test_module_caps_name_real_files_still_over_the_line() -> None:
    stale = [
        name
        for name in MODULE_CAPS
        if not (ROOT / name).is_file()
        or len((ROOT / name).read_text().splitlines()) <= MAX_MODULE_LINES
    ]
    assert not stale, f"caps no longer needed (drop them, so the rule holds): {stale}"
