"""Every file and test the docs, README and Makefile name exists: a reader who follows
"Checked by: `tests/test_x.py::test_y`" finds that test, and a path in prose is a real file.

A reference is a repository path with an extension (``runtime/…/x.py``, ``docs/x.md``), optionally
followed by ``::name`` (a test function or class in that file, parametrize ids dropped); a bare
``::name`` right after one names another test in the same file, as docs/protocols.md lists them.
Paths git ignores are generated outputs (``bench/results/``) and are not required to exist;
nor is a capitalised placeholder (``examples/NAME.py``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [
    *sorted(str(p.relative_to(ROOT)) for p in [*ROOT.glob("docs/**/*.md"), ROOT / "README.md"]),
    "Makefile",
]
_TOP = r"(?:runtime|actors|tests|property_tests|bench|scripts|docs|examples|\.ci)"
_PATH = rf"(?<![\w/.-])({_TOP}/[\w./-]*\.(?:py|md|sh|toml|ya?ml|jsonl?|txt|svg|png))"
REFERENCE = re.compile(rf"{_PATH}(?:::([\w.\[\]-]+))?|`::(\w+)")


def _ignored(paths: set[str]) -> set[str]:
    """The ones git ignores (generated outputs)."""
    if not paths:
        return set()
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", *sorted(paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    return set(done.stdout.split())


def _defines(path: Path, name: str) -> bool:
    name = name.split("[")[0].replace("::", ".").split(".")[-1]
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", path.read_text(),
                     re.MULTILINE) is not None  # fmt: skip


def broken_references(text: str) -> list[str]:
    """The references in ``text`` that name no file, or no test in the file they name."""
    found: list[tuple[str, str | None]] = []  # (path, name), a bare ::name under the last file
    last: str | None = None
    for match in REFERENCE.finditer(text):
        path, name, bare = match.groups()
        if path is not None:
            found.append((path, name))
            last = path if path.endswith(".py") else last
        elif last is not None:
            found.append((last, bare))
    # A capitalised stem that is no file is a placeholder (``python examples/NAME.py``).
    missing = {p for p, _ in found if not (ROOT / p).exists() and not Path(p).stem.isupper()}
    missing -= _ignored(missing)
    broken = sorted(missing)
    for path, name in found:
        file = ROOT / path
        if name and file.is_file() and file.suffix == ".py" and not _defines(file, name):
            broken.append(f"{path}::{name}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_file_and_test_the_document_names_exists(document: str) -> None:
    assert broken_references((ROOT / document).read_text()) == []


def test_the_checker_finds_a_missing_file_and_a_missing_test() -> None:
    text = (
        "Checked by `tests/test_doc_references.py::test_the_checker_finds_a_missing_file_and_a"
        "_missing_test`, `::no_such_test`; see `docs/no_such_doc.md`, `bench/results/x.jsonl` "
        "(generated) and `examples/NAME.py` (a placeholder)."
    )
    assert broken_references(text) == [
        "docs/no_such_doc.md",
        "tests/test_doc_references.py::no_such_test",
    ]
