"""What the load probe costs on the real models, next to the load it is part of.

For each model, ``--runs`` times (the models alternating), every cached verdict removed before
each of the first two loads:

- ``at_load``: the probe runs inside the load (``MlxOptions.load_probe="at_load"``);
- ``background`` (the default): the load leaves the probe to the engine; what the load still
  spends on it (``limit_by_probe``: the fingerprint and the pending info) is timed, then the
  probe's pieces are run as an idle engine would, each timed (the longest is the most a request
  waits behind one);
- ``cached``: a load that finds the verdict.

Prints each run, then the medians. Needs the models fetched (``mlxrt pull``). Run from the
repository root, with it on the path:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 PYTHONPATH=. \
        python scripts/probe_cost.py --runs 3 smollm2-135m-instruct gemma3-270m
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import runtime.backends.mlx.backend as mlx_backend
from runtime.backends.contract import ModelInfo
from runtime.backends.mlx.backend import MlxBackend
from runtime.backends.mlx.verdicts import probe_dir
from runtime.backends.model_source import prepare_model
from runtime.messages import ModelSpec

_in_load: list[float] = []  # seconds each load spent in limit_by_probe
_limit_by_probe = mlx_backend.limit_by_probe


def _timed_limit(*args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    try:
        return _limit_by_probe(*args, **kwargs)
    finally:
        _in_load.append(time.perf_counter() - start)


mlx_backend.limit_by_probe = _timed_limit  # type: ignore[assignment]


def _forget_verdicts() -> None:
    for verdict in probe_dir().glob("*.json"):  # a verdict is keyed by the caches too
        verdict.unlink()


def _load(spec: ModelSpec, defer: bool) -> tuple[float, MlxBackend]:
    start = time.perf_counter()
    backend = MlxBackend.load(spec, defer_probe=defer)
    return time.perf_counter() - start, backend


def _pieces(backend: MlxBackend) -> tuple[list[float], ModelInfo]:
    probe = backend.deferred_probe()
    assert probe is not None, "a load with no cached verdict and defer_probe leaves a probe"
    pieces: list[float] = []
    while True:
        start = time.perf_counter()
        info = probe.step()
        pieces.append(time.perf_counter() - start)
        if info is not None:
            return pieces, info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {m: [] for m in args.models}
    infos: dict[str, ModelInfo] = {}
    for run in range(args.runs):
        for model in args.models:
            spec = ModelSpec(name=model, path=model)
            prepare_model(spec)  # fetched and converted outside the timed loads
            _forget_verdicts()
            at_load_s, probed = _load(spec, defer=False)
            probed.close()
            _forget_verdicts()
            _in_load.clear()
            background_s, deferred = _load(spec, defer=True)
            in_load = sum(_in_load)
            pieces, info = _pieces(deferred)
            deferred.close()
            cached_s, cached = _load(spec, defer=True)
            cached.close()
            if probed.info.probe_cached or not cached.info.probe_cached:
                raise SystemExit(f"{model}: the first load must probe and the last use the cache")
            row = {
                "probe": probed.info.probe_s,
                "at_load": at_load_s,
                "background": background_s,
                "in_load": in_load,
                "pieces": sum(pieces),
                "longest": max(pieces),
                "cached": cached_s,
            }
            rows[model].append(row)
            infos[model] = info
            print(
                f"run {run + 1} {model}: at_load {at_load_s:.2f} s (probe {row['probe']:.2f} s, "
                f"{100 * row['probe'] / at_load_s:.1f}%); background {background_s:.2f} s "
                f"(probe work in it {1000 * in_load:.1f} ms = "
                f"{100 * in_load / background_s:.2f}%), then {len(pieces)} pieces "
                f"{row['pieces']:.2f} s (longest {row['longest']:.2f} s); cached {cached_s:.2f} s",
                flush=True,
            )
    for model, runs in rows.items():
        med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        share = statistics.median(r["in_load"] / r["background"] for r in runs)
        print(
            f"{model} (median of {len(runs)}): at_load: probe {med['probe']:.2f} s of a "
            f"{med['at_load']:.2f} s load; background: {1000 * med['in_load']:.1f} ms of a "
            f"{med['background']:.2f} s load ({100 * share:.2f}%), the pieces "
            f"{med['pieces']:.2f} s while idle, longest {med['longest']:.2f} s; cached-verdict "
            f"load {med['cached']:.2f} s; off: {infos[model].limits or 'none'}"
        )


if __name__ == "__main__":
    main()
