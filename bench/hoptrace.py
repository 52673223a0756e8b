"""Diagnostic: where a SmolLM2 request's time to first token goes, in-process and on Ray.

``python -m bench.hoptrace [N] [--worker-niceness K] [--grant-apart]``: N+1 alternating greedy
chat requests (the first a warm-up) on an in-process engine and on a Ray engine, each hop
timestamped with the system's monotonic clock (one clock for every process of the machine): the
engine core's mail, its compute jobs, the proxy's forwards and polls, the engine process's
deliveries, sends and takes. It prints, for each Ray engine, the median time of each hop from
the request to the first token collected by the host, and the Ray calls (with their messages)
into the engine's process and the collections out of it before that token; for each engine,
TTFT split into before the prefill, the prefill and after it. Not a bench row and not a test: it
wraps the classes' methods in place (here, and in the engine process through Ray's worker setup
hook), which nothing else may do.
``--worker-niceness 15``: Ray's own default for its workers, the priority engines ran at before
the runtime set it to 0 (docs/cluster.md, "Figures"). ``--grant-apart``: a second Ray engine
whose grant and lookup answer cross in a call each (``ClusterConfig.grant_with_lookup=False``),
alternating with the others: the merge's before and after in one run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

DIR = "/tmp/hoptrace"
_lock = threading.Lock()
_file = None


def log(what: str) -> None:
    global _file
    t = time.monotonic()
    with _lock:
        if _file is None:
            os.makedirs(DIR, exist_ok=True)
            _file = open(f"{DIR}/{os.getpid()}.log", "a", buffering=1)  # noqa: SIM115
        _file.write(f"{t:.6f} {os.getpid()} {threading.current_thread().name} {what}\n")


def setup() -> None:
    from actors.engine import compute as compute_mod
    from actors.engine.core import EngineCore

    handle = EngineCore.handle

    def traced_handle(self, message, sender, ctx):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        handle(self, message, sender, ctx)
        name = type(message).__name__
        if name != "Stats":
            log(f"engine.handle {name} took {1e3 * (time.monotonic() - t0):.2f}ms")

    EngineCore.handle = traced_handle  # type: ignore[method-assign]

    submit = compute_mod.ComputeSlot.submit

    def traced_submit(self, ctx, job, work):  # type: ignore[no-untyped-def]
        name = type(job).__name__
        log(f"compute.submit {name}")

        def timed() -> None:
            t0 = time.monotonic()
            log(f"compute.start {name}")
            work()
            log(f"compute.end {name} took {1e3 * (time.monotonic() - t0):.2f}ms")

        submit(self, ctx, job, timed)

    compute_mod.ComputeSlot.submit = traced_submit  # type: ignore[method-assign]

    try:
        from runtime.cluster import process as proc
        from runtime.cluster import proxy
    except ImportError:
        return
    deliver = proc.EngineProcess.deliver

    async def traced_deliver(self, number, items):  # type: ignore[no-untyped-def]
        log(f"process.deliver #{number} n={len(items)} bytes={sum(len(d) for _, d in items)}")
        await deliver(self, number, items)

    proc.EngineProcess.deliver = traced_deliver  # type: ignore[method-assign]
    take = proc.EngineProcess.take

    async def traced_take(self, wait_s):  # type: ignore[no-untyped-def]
        log("process.take in")
        out = await take(self, wait_s)
        log(f"process.take out n={len(out[0])}")
        return out

    proc.EngineProcess.take = traced_take  # type: ignore[method-assign]
    send = proc.EngineProcess.send

    def traced_send(self, to, message):  # type: ignore[no-untyped-def]
        log(f"process.send {type(message).__name__} -> {to}")
        send(self, to, message)

    proc.EngineProcess.send = traced_send  # type: ignore[method-assign]

    phandle = proxy.RemoteEngine.handle

    def traced_phandle(self, message, sender, ctx):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        phandle(self, message, sender, ctx)
        name = type(message).__name__
        log(f"proxy.handle {name} from {sender} took {1e3 * (time.monotonic() - t0):.2f}ms")

    proxy.RemoteEngine.handle = traced_phandle  # type: ignore[method-assign]
    run = proxy._Poll.run

    def traced_run(self):  # type: ignore[no-untyped-def]
        run(self)
        if self.items:  # an empty poll (it waited its time out) is no hop
            log(f"poll.got n={len(self.items)}")

    proxy._Poll.run = traced_run  # type: ignore[method-assign]


# ---------------------------------------------------------------------- the run and its reading

HOPS = (
    ("the proxy forwards Admit", "proxy.handle Admit"),
    ("Admit arrives in the engine", "process.deliver"),
    ("the prompt is tokenized", "compute.end TokenizeJob"),
    ("the engine sends Reserve", "process.send Reserve "),
    ("the host collects it", "poll.got"),
    ("the keeper's Reserved reaches the proxy", "proxy.handle Reserved"),
    ("the prefix manager's LookupResult too", "proxy.handle LookupResult"),
    ("LookupResult arrives in the engine", "process.deliver"),
)


def _hops(request: list[tuple[float, str]]) -> list[tuple[str, float]]:
    """(hop, ms) of one Ray request's trace, from its start to the host collecting its first
    token."""
    at, out = request[0][0], []

    def next_of(pattern: str, after: float) -> float:
        found = next((t for t, line in request if t >= after and pattern in line), None)
        if found is None:  # its mail crossed in another order (e.g. the lookup's answer first)
            raise LookupError(pattern)
        return found

    for name, pattern in HOPS:
        t = next_of(pattern, at)
        out.append((name, t - at))
        at = t
    end, took = _prefill(request)
    out.append(("the prefill starts", end - took - at))
    out.append(("the prefill", took))
    sent = next_of("process.send TokensProduced", end)
    out.append(("the first token is sent", sent - end))
    out.append(("the host collects it", next_of("poll.got n=", sent) - sent))
    return [(name, 1e3 * seconds) for name, seconds in out]


def _prefill(request: list[tuple[float, str]]) -> tuple[float, float]:
    """(when it ended, how long it took) of the request's prefill: its first long step."""
    for t, line in request:
        if "compute.end StepJob" in line and float(line.split()[-1][:-2]) > 50:
            return t, float(line.split()[-1][:-2]) / 1e3
    raise ValueError("no prefill in the trace")


Trace = list[tuple[float, str]]


def _requests(lines: list[str]) -> dict[str, list[tuple[float, Trace]]]:
    """The timed requests' traces (the warm-up left out), with their TTFT, by where they ran."""
    out: dict[str, list[tuple[float, Trace]]] = {}
    current: Trace = []
    for line in sorted(lines, key=lambda text: float(text.split()[0])):
        t = float(line.split()[0])
        if "=== request" in line:
            current = []
        current.append((t, line))
        if "=== first token" in line and "rep=0 " not in line:
            ttft = float(line.rsplit("ttft=", 1)[1].removesuffix("ms"))
            where = line.split(" on=", 1)[1].split()[0]
            out.setdefault(where, []).append((ttft, current))
    return out


def _crossings(trace: Trace) -> tuple[int, int, int]:
    """(Ray calls in, messages in them, collections out) of one request until the host collected
    its first token (that collection included; the trace runs on to the stream's end)."""
    sent, engine = next((t, line.split()[1]) for t, line in trace if "send TokensProduced" in line)
    end = next(t for t, line in trace if t >= sent and "poll.got" in line)
    lines = [line for t, line in trace if t <= end]
    # Its engine's process only: another engine's mail may cross meanwhile (a late Committed).
    calls = [line for line in lines if "process.deliver" in line and line.split()[1] == engine]
    messages = sum(int(line.split(" n=", 1)[1].split()[0]) for line in calls)
    return len(calls), messages, sum(1 for line in lines if "poll.got" in line)


def _report(lines: list[str]) -> None:
    import statistics

    requests = _requests(lines)
    for where, rows in requests.items():
        splits = []
        for ttft, trace in rows:
            end, took = _prefill(trace)
            before = 1e3 * (end - took - trace[0][0])
            splits.append((ttft, before, 1e3 * took, ttft - before - 1e3 * took))
        medians = [statistics.median(split[i] for split in splits) for i in range(4)]
        print(f"{where:15s} TTFT {medians[0]:6.1f} ms = before the "
              f"prefill {medians[1]:5.1f} + prefill {medians[2]:6.1f} + after {medians[3]:4.1f} "
              f"(medians of {len(splits)}: {[round(s[0], 1) for s in splits]})")  # fmt: skip
    for where, rows in requests.items():
        if where == "in_process":
            continue
        crossings = sorted({_crossings(trace) for _, trace in rows})
        print(f"  {where}: (Ray calls in, messages, collections out) before the first token: "
              f"{crossings}")  # fmt: skip
        hops = []
        for _, trace in rows:
            with contextlib.suppress(LookupError):
                hops.append(_hops(trace))
        print(f"  {where}: hops of the {len(hops)} requests whose mail crossed in the usual order")
        for i, (name, _) in enumerate(hops[0] if hops else ()):
            print(f"  {where}: {name:40s} +{statistics.median(h[i][1] for h in hops):7.2f} ms")


def main() -> None:
    import shutil
    import sys

    import anyio
    import ray

    from bench import cluster
    from runtime.backends.model_source import prepare_model
    from runtime.host.api import Runtime
    from runtime.messages import ModelSpec

    args = sys.argv[1:]
    niceness = 0
    grant_apart = "--grant-apart" in args
    args = [arg for arg in args if arg != "--grant-apart"]
    if "--worker-niceness" in args:
        at = args.index("--worker-niceness")
        niceness = int(args[at + 1])
        del args[at : at + 2]
    repetitions = int(args[0]) if args else 5
    shutil.rmtree(DIR, ignore_errors=True)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p
    )
    cpus = 4 if grant_apart else 2  # each Ray engine has 2
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, _system_config={"worker_niceness": niceness},
             runtime_env={"worker_process_setup_hook": "bench.hoptrace.setup"})  # fmt: skip
    # Patched by the module's own name: run as __main__, Ray would pickle the patches by value.
    from bench import hoptrace

    hoptrace.setup()
    log = hoptrace.log
    spec = ModelSpec(name="smollm2", path="smollm2-135m-instruct")
    prepare_model(spec)

    configs = {"in_process": cluster._config(False), "ray": cluster._config(True, 2.0)}
    if grant_apart:
        configs["ray_grant_apart"] = cluster._config(True, 2.0, grant_with_lookup=False)

    async def run() -> None:
        async with contextlib.AsyncExitStack() as stack:
            runtimes = {}
            for where, config in configs.items():
                runtimes[where] = rt = await stack.enter_async_context(Runtime(config))
                await rt.load_model(spec)
            for repetition in range(repetitions + 1):
                for where, rt in runtimes.items():
                    log(f"=== request rep={repetition} on={where}")
                    first, _, _ = await cluster._one_stream(rt, spec.name, repetition, 8)
                    log(f"=== first token rep={repetition} on={where} ttft={first * 1e3:.1f}ms")

    anyio.run(run)
    ray.shutdown()
    lines: list[str] = []
    for name in os.listdir(DIR):
        with open(f"{DIR}/{name}") as file:
            lines += file.read().splitlines()
    _report(lines)


if __name__ == "__main__":
    main()
