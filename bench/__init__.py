"""Benchmarks: our runtime vs raw mlx-lm vs ``mlx_lm.server`` on the same tiny model.

Run ``python -m bench --help`` (``make bench`` runs it with OpenBLAS preloaded, then
``python -m bench.report``, which writes docs/performance.md, its plots and README's headline).
"""

# Before any bench module imports mlx: importing runtime loads OpenBLAS for MLX (runtime/blas.py),
# so `python -m bench` run without the Makefile's LD_PRELOAD is not on MLX's slow reference BLAS.
import runtime  # noqa: F401
