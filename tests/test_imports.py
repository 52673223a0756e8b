"""Importing the runtime imports MLX and mlx-lm (which imports transformers) only when needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

# Runs in a fresh interpreter: this test process has imported MLX long ago.
LOAD_A_SIMULATED_MODEL = textwrap.dedent(
    """
    import sys

    import anyio

    from runtime.api import Runtime
    from runtime.config import RuntimeConfig
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
