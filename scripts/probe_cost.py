"""What the load probe costs on the real models, next to the load it is part of.

For each model: its cached verdict is removed, the model loaded (the probe runs), then loaded
again (the verdict is read from the cache). Prints the probe's seconds, each load's seconds, and
the probe's share of the first load. Needs the models fetched (``mlxrt pull``).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        python scripts/probe_cost.py smollm2-135m-instruct gemma3-270m
"""

from __future__ import annotations

import sys
import time

from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.mlx.verdicts import fingerprint, verdict_file
from runtime.backends.model_source import prepare_model
from runtime.messages import ModelSpec


def main(models: list[str]) -> None:
    for model in models:
        spec = ModelSpec(name=model, path=model)
        path = prepare_model(spec).path
        verdict_file(fingerprint(path, None)).unlink(missing_ok=True)
        timings = []
        for _ in range(2):
            start = time.perf_counter()
            backend = MlxBackend.load(spec)
            timings.append((time.perf_counter() - start, backend.info))
            backend.close()
        (probed_s, info), (cached_s, again) = timings
        if info.probe_cached or not again.probe_cached:
            raise SystemExit(f"{model}: the first load must probe and the second use the cache")
        print(
            f"{model}: probe {info.probe_s:.3f} s; load with probe {probed_s:.2f} s, "
            f"with the cached verdict {cached_s:.2f} s; probe = "
            f"{100 * info.probe_s / probed_s:.1f}% of the first load; off: {info.limits or 'none'}"
        )
        for verdict in info.capabilities:
            print(f"  {verdict.capability}: {'on' if verdict.on else 'off'} "
                  f"(max diff {verdict.max_diff}) {verdict.why}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:] or ["smollm2-135m-instruct", "gemma3-270m"])
