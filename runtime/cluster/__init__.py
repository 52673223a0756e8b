"""Engines in processes of their own, on any node of a Ray cluster (docs/cluster.md).

Only ``options`` (the config struct) and ``outbox`` import without Ray; the rest imports Ray, an
optional extra (``pip install 'mlx-actor-runtime[cluster]'``), and is imported only when a
``RuntimeConfig.cluster`` is set.
"""
