"""``make soak``: the simulated soak and the real-model HTTP soak, with their figures.

    python scripts/soak.py [--seed N] [--requests N] [--http-requests N] [--skip-http]

Exits 1 if either soak finds a problem (each is listed). Both are described, with the figures
of a run, in docs/reliability.md, "Soak".
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import anyio

from bench.soak.driver import run_soak
from bench.soak.http_soak import HttpSoakConfig, run_http_soak
from bench.soak.plan import SoakConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--http-requests", type=int, default=200)
    parser.add_argument("--skip-http", action="store_true")
    args = parser.parse_args()
    problems = simulated(args.seed, args.requests)
    if not args.skip_http:
        problems += over_http(args.seed, args.http_requests)
    max_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"max RSS of this process: {max_rss_mib:.0f} MiB")
    for problem in problems:
        print("PROBLEM:", problem)
    print("soak:", "FAILED" if problems else "passed")
    return 1 if problems else 0


def simulated(seed: int, requests: int) -> list[str]:
    config = SoakConfig(seed=seed, requests=requests, unload_after=requests // 2)
    started = time.perf_counter()
    report = anyio.run(run_soak, config)
    print(
        f"simulated soak: {requests} requests, seed {seed}, {time.perf_counter() - started:.1f} s"
    )
    print("  endings:", dict(sorted(report.tally().items())))
    paths = [o.path for o in report.outcomes if o.path]
    print("  reuse paths:", {p: paths.count(p) for p in sorted(set(paths))})
    c = report.counters
    print(
        f"  KV: {c.get('queued', 0)} reservations queued, {c.get('evictions', 0)} entries evicted;"
        f" at quiescence {report.reserved_at_quiescence} B reserved ="
        f" {report.prefix_bytes_at_quiescence} B of prefix entries; after reset"
        f" {report.reserved_after_reset} B"
    )
    print(
        f"  tasks: {report.tasks_before} before the runtime, {report.tasks_after} after;"
        f" inside it {sum(report.tasks_loaded.values())} loaded,"
        f" {sum(report.tasks_quiescent.values())} at quiescence"
        f" ({report.pending_timers} pending timers:"
        f" {dict(report.tasks_quiescent - report.tasks_loaded)})"
    )
    print(f"  threads: {report.threads_loaded} loaded, {report.threads_quiescent} at quiescence")
    return [f"simulated: {p}" for p in report.problems()]


def over_http(seed: int, requests: int) -> list[str]:
    config = HttpSoakConfig(seed=seed, requests=requests)
    started = time.perf_counter()
    report = anyio.run(run_http_soak, config)
    total = time.perf_counter() - started
    print(
        f"HTTP soak (default model): {requests} requests from {config.clients} clients,"
        f" {report.seconds:.1f} s ({total:.1f} s with load and cold replies)"
    )
    print("  endings:", dict(sorted(report.tally().items())))
    c = report.engine_counters
    print(
        f"  engine: {c.get('cancelled', 0)} cancelled, {c.get('batch_steps', 0)} batch steps,"
        f" reuse trim {c.get('path_trim', 0)} / exact {c.get('path_exact', 0)} /"
        f" miss {c.get('path_miss', 0)}"
    )
    print(
        f"  KV at quiescence {report.reserved_at_quiescence} B ="
        f" {report.prefix_bytes_at_quiescence} B of prefix entries; after reset"
        f" {report.reserved_after_reset} B"
    )
    delta = report.active_memory_after - report.active_memory_baseline
    print(
        f"  MLX active memory: {report.active_memory_baseline} B before, "
        f"{report.active_memory_after} B after the reset ({delta:+d} B);"
        f" peak {report.peak_memory} B"
    )
    return [f"http: {p}" for p in report.problems()]


if __name__ == "__main__":
    sys.exit(main())
