"""Benchmarks: our runtime vs raw mlx-lm vs ``mlx_lm.server`` on the same tiny model.

Run ``python -m bench --help`` (``make bench`` runs it with OpenBLAS preloaded, then
``python -m bench.report``, which writes docs/performance.md, its plots and README's headline).
"""
