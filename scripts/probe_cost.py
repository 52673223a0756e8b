"""What the load probe costs on the real models, next to the load it is part of.

For each model, ``--runs`` times (the models alternating): its cached verdict is removed, the model
loaded (the probe runs), then loaded again (the verdict is read from the cache). Prints each
load's seconds, the probe's seconds and its share of the first load, then the medians. Needs the
models fetched (``mlxrt pull``). Run from the repository root, with it on the path:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 PYTHONPATH=. \
        python scripts/probe_cost.py --runs 3 smollm2-135m-instruct gemma3-270m
"""

from __future__ import annotations

import argparse
import statistics
import time

from runtime.backends.contract import ModelInfo
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.mlx.verdicts import fingerprint, verdict_file
from runtime.backends.model_source import prepare_model
from runtime.messages import ModelSpec


def _load(spec: ModelSpec) -> tuple[float, ModelInfo]:
    start = time.perf_counter()
    backend = MlxBackend.load(spec)
    seconds = time.perf_counter() - start
    backend.close()
    return seconds, backend.info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in args.models}
    infos: dict[str, ModelInfo] = {}
    for run in range(args.runs):
        for model in args.models:
            spec = ModelSpec(name=model, path=model)
            verdict_file(fingerprint(prepare_model(spec).path, None)).unlink(missing_ok=True)
            (probed_s, info), (cached_s, again) = _load(spec), _load(spec)
            if info.probe_cached or not again.probe_cached:
                raise SystemExit(f"{model}: the first load must probe and the second use the cache")
            rows[model].append((info.probe_s, probed_s, cached_s))
            infos[model] = info
            print(
                f"run {run + 1} {model}: probe {info.probe_s:.3f} s; first load {probed_s:.2f} s "
                f"(probe {100 * info.probe_s / probed_s:.1f}%); load with the cached verdict "
                f"{cached_s:.2f} s",
                flush=True,
            )
    for model, runs in rows.items():
        probe, first, cached = (statistics.median(column) for column in zip(*runs, strict=True))
        print(
            f"{model} (median of {len(runs)}): probe {probe:.3f} s = "
            f"{100 * statistics.median(p / f for p, f, _ in runs):.1f}% of the first load "
            f"({first:.2f} s); cached-verdict load {cached:.2f} s (probe 0%); "
            f"off: {infos[model].limits or 'none'}"
        )
        for verdict in infos[model].capabilities:
            print(f"  {verdict.capability}: {'on' if verdict.on else 'off'} "
                  f"(max diff {verdict.max_diff}) {verdict.why}")  # fmt: skip


if __name__ == "__main__":
    main()
