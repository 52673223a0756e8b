"""Every file and test the docs, README and Makefile name exists: a reader who follows
"Checked by: `tests/test_x.py::test_y`" finds that test, and a path in prose is a real file.

A reference is a repository path with an extension (``runtime/…/x.py``, ``docs/x.md``), optionally
followed by ``::name`` (a test function or class in that file, parametrize ids dropped); a bare
``::name`` right after one names another test in the same file, as docs/protocols.md lists them.
Paths git ignores are generated outputs (``bench/results/``) and are not required to exist;
nor is a capitalised placeholder (``examples/NAME.py``). Two more forms are resolved: a markdown
link's target, relative to the document (``[plot](perf/ttft.png)``), and a test named on its own in
backticks (```test_x_does_y```), which must be a test function, class or module somewhere in
tests/ or property_tests/.
"""

from __future__ import annotations

import functools
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
# A markdown link to a file next to the document: no scheme, no anchor-only link.
LINK = re.compile(r"\]\((?![a-z]+:|#)([^)\s#]+)(?:#[^)]*)?\)")
# A test named alone: `test_...` in backticks, not part of a path or a `::name` reference.
BARE_TEST = re.compile(r"(?<![:/\w.])`(test_\w+)`")
TEST_ROOTS = ("tests", "property_tests")


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


def broken_links(document: Path) -> list[str]:
    """The markdown links in ``document`` whose target is no file next to it."""
    text = document.read_text()
    return sorted(
        target
        for target in set(LINK.findall(text))
        if not (document.parent / target).exists() and not Path(target).stem.isupper()
    )


@functools.cache
def _test_names() -> frozenset[str]:
    """Every test function, class and module name under tests/ and property_tests/."""
    names: set[str] = set()
    for root in TEST_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            names.add(path.stem)
            names.update(re.findall(r"^\s*(?:async\s+)?(?:def|class)\s+(\w+)", path.read_text(),
                                    re.MULTILINE))  # fmt: skip
    return frozenset(names)


def unknown_test_names(text: str, known: frozenset[str]) -> list[str]:
    """The tests named alone in ``text`` that no test file defines."""
    return sorted({name for name in BARE_TEST.findall(text) if name not in known})


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_file_and_test_the_document_names_exists(document: str) -> None:
    text = (ROOT / document).read_text()
    assert broken_references(text) == []
    assert unknown_test_names(text, _test_names()) == []
    assert broken_links(ROOT / document) == []


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


def test_the_checker_finds_a_broken_link_and_an_unknown_test_name(tmp_path: Path) -> None:
    (tmp_path / "here.png").write_bytes(b"")
    document = tmp_path / "doc.md"
    document.write_text("[a](here.png) [b](gone.png) [c](https://x.org/y.md) [d](#anchor)")
    assert broken_links(document) == ["gone.png"]
    text = "`test_the_checker_finds_a_broken_link_and_an_unknown_test_name`, `test_no_such_thing`"
    assert unknown_test_names(text, _test_names()) == ["test_no_such_thing"]
