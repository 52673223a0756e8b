"""Importing the runtime imports MLX and mlx-lm (which imports transformers) only when needed."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import runtime

# Runs in a fresh interpreter: this test process has imported MLX long ago.
LOAD_A_SIMULATED_MODEL = textwrap.dedent(
    """
    import sys

    import anyio

    from runtime.host.api import Runtime
    from runtime.host.config import RuntimeConfig
    from runtime.messages import ModelLoaded, ModelSpec
    from runtime.testing.simulator import Simulator

    SPEC = ModelSpec(name="m", backend="simulated")


    async def main() -> None:
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
            await rt.load_model(SPEC)


    anyio.run(main)
    assert isinstance(Simulator().load(SPEC), ModelLoaded)
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "transformers")))
    """
)


def test_loading_a_simulated_model_imports_neither_mlx_nor_mlx_lm() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOAD_A_SIMULATED_MODEL],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[1],  # the repository root, where `runtime` lives
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# The package root's names load lazily; an actor module imported first must not make them circular.
LOAD_THROUGH_THE_PACKAGE_ROOT = textwrap.dedent(
    """
    import sys

    import actors.router  # before `runtime`: the root must not import the actors eagerly
    import anyio

    import runtime
    from runtime import ModelLoaded, ModelSpec, Runtime, RuntimeConfig


    async def main() -> None:
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 20)) as rt:
            loaded = await rt.load_model(ModelSpec(name="m", backend="simulated"))
            assert isinstance(loaded, ModelLoaded)


    anyio.run(main)
    for name in runtime.__all__:
        getattr(runtime, name)
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm", "transformers")))
    """
)


def test_the_package_root_exports_load_a_simulated_model_without_mlx() -> None:
    done = subprocess.run(
        [sys.executable, "-c", LOAD_THROUGH_THE_PACKAGE_ROOT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_every_root_export_is_its_home_modules_object() -> None:
    homes = runtime._HOMES
    listed = [name for names in homes.values() for name in names]
    assert sorted(listed) == sorted(runtime.__all__)
    assert len(set(runtime.__all__)) == len(runtime.__all__)
    for module, names in homes.items():
        for name in names:
            assert getattr(runtime, name) is getattr(importlib.import_module(module), name)


def test_an_unknown_root_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Engine'"):
        runtime.Engine  # noqa: B018


def test_every_root_export_is_listed_in_the_api_docs_imports_section() -> None:
    api_md = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    section = api_md.split("\n## Imports\n", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`(\w+)`", section))
    missing = sorted(set(runtime.__all__) - documented)
    assert not missing, f"add to docs/api.md, Imports: {', '.join(missing)}"
