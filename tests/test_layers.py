"""The import direction reads from the tree (docs/design.md, "Layers"): every import in production
code, function-local ones included, points to the same layer or one below, and no module imports
``runtime.testing``. Checked on the source, so a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Lowest first. A module may import its own layer and every layer listed before it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("platform", ("runtime.blas",)),
    ("protocol", ("runtime.messages", "runtime.errors", "runtime.progress")),
    ("kernel", ("runtime.kernel",)),
    ("text", ("runtime.text",)),
    ("backends", ("runtime.backends",)),
    ("actors", ("actors",)),
    ("cluster", ("runtime.cluster",)),
    ("face", ("runtime.config", "runtime.validation", "runtime.streams", "runtime.api")),
    ("server", ("runtime.server",)),
    ("entry points", ("runtime.cli", "runtime.demo", "runtime")),
    ("test support", ("runtime.testing",)),
]

# The one upward import: with no network the demo tours the random-weight models the test kit
# builds, so `make run` still shows the runtime working offline.
ALLOWED = {("runtime.demo", "runtime.testing.tiny_models")}


def _layer_of(module: str) -> int:
    best, best_len = -1, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if matches and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in ("runtime", "actors")}


SOURCES = sorted(p for d in ("runtime", "actors") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: pathlib.Path) -> None:
    module = _module_name(path)
    rank = _layer_of(module)
    assert rank >= 0, f"{module} is in no layer: add it to LAYERS and docs/design.md"
    for imported in _imports(path) - {i for m, i in ALLOWED if m == module}:
        imported_rank = _layer_of(imported)
        assert imported_rank <= rank, (
            f"{module} ({LAYERS[rank][0]}) imports {imported} ({LAYERS[imported_rank][0]})"
        )


def test_production_never_imports_test_support() -> None:
    offenders = [
        f"{_module_name(p)} -> {name}"
        for p in SOURCES
        if not _module_name(p).startswith("runtime.testing")
        for name in _imports(p)
        if name.startswith("runtime.testing") and (_module_name(p), name) not in ALLOWED
    ]
    assert offenders == []


def test_no_import_circles() -> None:
    graph = {_module_name(p): _imports(p) for p in SOURCES}
    modules = set(graph)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges = {m: {r for n in deps if (r := resolve(n)) and r != m} for m, deps in graph.items()}
    # A package's __init__ re-exporting its own modules is not a circle through them.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in edges[node]:
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
