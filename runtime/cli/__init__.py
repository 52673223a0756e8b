"""``mlxrt``, the command line: one module per sub-command (chat.py, generate.py, serve.py,
models.py for ps/load/unload/models, cache.py, demo.py), the flags they share in flags.py, and
mlxrt.py, which builds the parser from them and dispatches (docs/cli.md). ``runtime.cli:main`` is
the console script pyproject.toml names."""

from __future__ import annotations

from runtime.cli.mlxrt import main

__all__ = ["main"]
