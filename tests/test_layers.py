"""The folders are the layers (docs/design.md, "Layers"): each top folder of ``runtime/`` (and
``actors/``) is one layer, and the root of ``runtime/`` holds only the few modules named here. Every
import in production code, function-local ones included, points to the same layer or one below, and
no module imports ``runtime.testing``. Checked on the source, so a lazy import cannot hide a circle;
a new folder or root module fails until it is given a layer here and in the design doc."""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Lowest first: a module may import its own layer and every layer listed before it. Each entry is a
# folder (``runtime/kernel``) or one of the root modules (``runtime/errors.py``).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("platform", ("runtime/blas.py",)),
    ("protocol", ("runtime/messages", "runtime/errors.py", "runtime/progress.py")),
    ("kernel", ("runtime/kernel",)),
    ("text", ("runtime/text",)),
    ("backends", ("runtime/backends",)),
    ("actors", ("actors",)),
    ("cluster", ("runtime/cluster",)),
    ("host", ("runtime/host", "runtime/__init__.py")),
    ("server", ("runtime/server",)),
    ("cli", ("runtime/cli",)),
    ("test support", ("runtime/testing",)),
]

# The one upward import: with no network the demo tours the random-weight models the test kit
# builds, so `make run` still shows the runtime working offline.
ALLOWED = {("runtime.cli.demo", "runtime.testing.tiny_models")}

_PLACES = {place: rank for rank, (_, places) in enumerate(LAYERS) for place in places}


def _place_of(path: pathlib.Path) -> str:
    """The folder or root module a source file belongs to: ``runtime/kernel`` for every file under
    it, ``runtime/errors.py`` for the root module itself."""
    parts = path.relative_to(ROOT).parts
    return "/".join(parts[:2]) if parts[0] == "runtime" else parts[0]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = sorted(p for d in ("runtime", "actors") for p in (ROOT / d).rglob("*.py"))
_FILE_OF = {_module_name(p): p for p in SOURCES}


def _layer_of_module(name: str) -> int:
    """The layer of an imported name, from the file it resolves to (``runtime.messages.X`` is the
    package ``runtime/messages``)."""
    module = name
    while module and module not in _FILE_OF:
        module = module.rpartition(".")[0]
    assert module, f"{name} resolves to no source file"
    return _PLACES[_place_of(_FILE_OF[module])]


def _imports(path: pathlib.Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name.split(".")[0] in ("runtime", "actors")}


def test_every_folder_and_root_module_is_a_layer() -> None:
    """``runtime/``'s root holds only the modules LAYERS names; every folder there is a layer."""
    found = {
        _place_of(entry)
        for entry in (ROOT / "runtime").iterdir()
        if entry.suffix == ".py" or (entry / "__init__.py").exists()
    }
    assert found - set(_PLACES) == set(), "give it a layer here and in docs/design.md, Layers"
    assert set(_PLACES) - {"actors"} <= found, "a layer names a folder or module that is gone"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path: pathlib.Path) -> None:
    module = _module_name(path)
    rank = _PLACES[_place_of(path)]
    for imported in _imports(path) - {i for m, i in ALLOWED if m == module}:
        imported_rank = _layer_of_module(imported)
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


def test_the_wheel_imports_no_test_dependency() -> None:
    """A plain install has none of the ``test`` extra: no module of the wheel (runtime/, actors/,
    runtime/testing/ included) may import one, even lazily. The HTTP soak, which needs httpx,
    lives in bench/soak/ for this reason."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~;\[ ]", r)[0].lower().replace("-", "_") for r in requirements}

    # The test extra also pulls in the other extras (Ray, mlx-vlm) so CI covers them; those are
    # imported lazily by design and stay allowed.
    others = names(project["dependencies"]).union(
        *(names(r) for extra, r in extras.items() if extra != "test")
    )
    test_only = names(extras["test"]) - others
    offenders: list[str] = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            imported: list[str] = []
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported = [node.module]
            bad = [name for name in imported if name.split(".")[0] in test_only]
            offenders += [f"{_module_name(path)} -> {name}" for name in bad]
    assert test_only >= {"httpx", "pytest", "hypothesis"}
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
