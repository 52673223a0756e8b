"""``python -m runtime.cli``: the same as the ``mlxrt`` console script."""

from __future__ import annotations

import sys

from runtime.cli.mlxrt import main

sys.exit(main())
