"""``python -m bench``: our runtime vs raw mlx-lm, ``mlx_lm.server`` and llama.cpp's
``llama-server`` on the same models (and our runtime on llama.cpp where it is installed).

Prints one JSON object per measurement (to stdout, or to ``--json PATH``), then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
from collections.abc import Sequence
from typing import IO

# Rows measure serving with the load probe's verdict in place, whatever the probe cache holds (a
# first load otherwise serves limited until the probe has run while idle); the probe's own cost is
# scripts/probe_cost.py's. Set before any model loads, here and in the servers the bench starts.
os.environ.setdefault("MLXRT_LOAD_PROBE", "at_load")

from bench import (
    batching,
    checkpoints,
    cluster,
    disk,
    disk_peers,
    environment,
    generation,
    hop,
    llamacpp,
    ours,
    over_http,
    raw_mlx,
    server,
    speculative,
    structured,
)
from bench.models import MODELS, REAL_MODELS, BenchModel, load_bench_model
from bench.results import SYSTEMS, Sink, format_table
from bench.serving import ServerCommand, mlx_lm_server
from bench.workload import SIZES, build_workload
from runtime.messages import ModelSpec

SCENARIO_GROUPS = (
    "existing",
    "generation",
    "checkpoints",
    "batching",
    "structured",
    "speculative",
    *over_http.GROUPS,
    "hop",
    "cluster",
    "disk",
)
MODEL_FREE_GROUPS = {"hop"}
SERVER_GROUPS = {"existing", *over_http.GROUPS}  # the groups the llama.cpp servers have rows in
LLAMACPP_GROUPS = {*SERVER_GROUPS, "disk"}  # and llama-server's slot save/restore in disk
RAY = importlib.util.find_spec("ray") is not None  # the cluster group needs the [cluster] extra


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma-separated subset of: llama, sliding, hybrid (tiny random-weight models), "
        "smollm2 (SmolLM2-135M-Instruct), gemma3 (Gemma 3 270M)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run of every row: small sizes, 1 repetition"
    )
    parser.add_argument("--json", metavar="PATH", help="write JSON lines here, not to stdout")
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated subset of: runtime, mlx-lm, mlx_lm.server, llama-server "
        "(llama.cpp's own, built once by scripts/build-llama-server.sh; real models only), "
        "ours-llamacpp (mlxrt serve --backend llamacpp; real models only)",
    )
    parser.add_argument(
        "--llama-threads",
        type=int,
        default=llamacpp.THREADS,
        metavar="N",
        help=f"llama-server's --threads (default {llamacpp.THREADS}, this machine's cores)",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIO_GROUPS),
        help="comma-separated subset of: existing (turn2, abandon, decode), generation "
        "(gen.*: one-stream decode, 4 concurrent, inter-token latency, coalescing; runtime "
        "and mlx-lm only), checkpoints (ckpt.*: memory of a long prompt's checkpoints, runtime "
        "vs deep copies of mlx-lm's prompt cache), batching (batch.*: decode tokens/s of one "
        "sequence alone vs four in a DecodeBatch, backend level), structured (structured.*: "
        "decode ms/token under a JSON Schema vs none, runtime), speculative (speculative.*: "
        "decode tok/s on copying workloads and free chat, prompt lookup on and off, mlx-lm, "
        "mlx_lm.server); over HTTP, mlxrt serve vs "
        "mlx_lm.server: concurrency (1/2/4/8 streams at once), keystroke (a completion per "
        "keystroke, each superseding the last), prewarm (TTFT after a prewarm vs cold), branch "
        "(TTFT and tokens re-processed when ~900/~1,800 tokens of notes are re-sent with their "
        "last line changed); hop "
        "(hop.*: the actor message hop and the runtime's cost per streamed token, no model); "
        "disk (disk.*: TTFT of a 2,000-token prompt in a fresh process, a disk hit vs cold; "
        "mlx-lm: its prompt cache file, llama-server: its slot save/restore); "
        "cluster (cluster.*: an engine as a Ray actor against in-process, and routing across "
        "two replicas; real models only, docs/cluster.md)",
    )
    args = parser.parse_args(argv)
    args.scenarios = {s for s in args.scenarios.split(",") if s}
    unknown_groups = args.scenarios - set(SCENARIO_GROUPS)
    if unknown_groups:
        parser.error(f"unknown scenarios {sorted(unknown_groups)}; choose from {SCENARIO_GROUPS}")
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}; choose from {MODELS}")
    args.systems = {s for s in args.systems.split(",") if s}
    unknown_systems = args.systems - set(SYSTEMS)
    if unknown_systems:
        parser.error(f"unknown systems {sorted(unknown_systems)}; choose from {SYSTEMS}")
    if args.llama_threads < 1:
        parser.error("--llama-threads must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.kernel.actor import release_thread_resources

    args = _parse(argv)
    began = time.perf_counter()
    with contextlib.ExitStack() as stack:
        out: IO[str] = sys.stdout
        if args.json:
            out = stack.enter_context(open(args.json, "w", encoding="utf-8"))
        sink = Sink(out)
        found = _find_llamacpp(args)
        llama_meta = {} if found is None else {"llama.cpp": found.describe()}
        sink.meta({**environment.describe("quick" if args.quick else "full"), **llama_meta})
        if "hop" in args.scenarios and "runtime" in args.systems:
            _log("hop: actor message hop and per-token cost (runtime, simulated backend)")
            sink.extend(hop.measure(hop.HOP_QUICK if args.quick else hop.HopSizes()))
        models = args.models if args.scenarios - MODEL_FREE_GROUPS else []
        for kind in models:
            loaded = load_bench_model(kind)
            path, model, tokenizer = loaded.path, loaded.model, loaded.tokenizer
            _log(f"{kind}: {path}" + (f" ({loaded.note})" if loaded.note else ""))
            if "generation" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: generation (runtime, backend level, mlx-lm stream_generate)")
                gen_sizes = generation.GEN_SIZES.pick(loaded, args.quick)
                sink.extend(generation.measure(path, model, tokenizer, kind, gen_sizes))
            if "checkpoints" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: checkpoint memory (runtime vs mlx-lm whole-cache copies)")
                ckpt_tokens = checkpoints.PROMPT_TOKENS.pick(loaded, args.quick)
                sink.extend(checkpoints.measure(path, model, tokenizer, kind, ckpt_tokens))
            if "disk" in args.scenarios:
                _disk(args, loaded, found, sink)
            if "structured" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: constrained decoding (a JSON Schema vs none, runtime)")
                rounds = structured.ROUNDS.pick(loaded, args.quick)
                sink.extend(structured.measure(path, kind, rounds))
            if "speculative" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: speculative (prompt lookup on and off, mlx-lm, mlx_lm.server)")
                sink.extend(speculative.measure(loaded, args.systems, args.quick))
            if "batching" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: backend-level batching (B=1 loop vs a DecodeBatch of four)")
                batch_sizes = batching.BATCH_SIZES.pick(loaded, args.quick)
                sink.extend(batching.measure(path, tokenizer, kind, batch_sizes))
            llama_servers = [] if found is None else _llama_servers(found, loaded, sink)
            if "cluster" in args.scenarios and "runtime" in args.systems and loaded.real and RAY:
                _log(f"{kind}: cluster (a Ray engine vs in-process; routing across 2 replicas)")
                spec = ModelSpec(name=kind, path=str(path))
                sizes = cluster.CLUSTER_QUICK if args.quick else cluster.ClusterSizes()
                sink.extend(cluster.measure(spec, kind, sizes))
            http_groups = [group for group in over_http.GROUPS if group in args.scenarios]
            if http_groups:
                _log(f"{kind}: {', '.join(http_groups)} (the servers, over HTTP)")
                sink.extend(
                    over_http.measure(loaded, http_groups, args.systems, args.quick, llama_servers)
                )
            if "existing" not in args.scenarios:
                continue
            work = build_workload(tokenizer, SIZES.pick(loaded, args.quick))
            if "mlx-lm" in args.systems:
                _log(f"{kind}: raw mlx-lm")
                sink.extend(raw_mlx.measure(model, kind, work))
            if "runtime" in args.systems:
                _log(f"{kind}: runtime")
                sink.extend(ours.measure(path, kind, work))
            mlx_server = [mlx_lm_server(path)] if "mlx_lm.server" in args.systems else []
            servers = [*mlx_server, *llama_servers]
            if servers:
                _log(f"{kind}: {', '.join(c.system for c in servers)} (in turns)")
                sink.extend(server.measure(servers, kind, work))
    mode = "quick" if args.quick else "full"
    print(f"\n# bench ({mode}; {time.perf_counter() - began:.0f}s)", file=sys.stderr)
    print(format_table(sink.items), file=sys.stdout if args.json else sys.stderr)
    release_thread_resources()  # raw mlx-lm ran on this thread: MLX needs its streams cleared
    return 0


def _find_llamacpp(args: argparse.Namespace) -> llamacpp.Found | None:
    """What the llama.cpp systems need, when the run has rows for them (a real model, a server
    group); None otherwise, so a run without them builds nothing."""
    wanted = args.systems & set(llamacpp.SYSTEMS)
    real = any(m in REAL_MODELS for m in args.models)
    if not wanted or not real or not args.scenarios & LLAMACPP_GROUPS:
        return None
    _log(f"llama.cpp: looking for {', '.join(sorted(wanted))} (a first build takes ~12 min)")
    found = llamacpp.find(args.systems, args.llama_threads)
    for system, line in found.describe().items():
        _log(f"llama.cpp: {system}: {line}")
    return found


def _disk(
    args: argparse.Namespace, model: BenchModel, found: llamacpp.Found | None, sink: Sink
) -> None:
    """The disk group: ours, then mlx-lm's prompt cache file and llama-server's slot restore."""
    if "runtime" in args.systems:
        _log(f"{model.name}: disk (TTFT in a fresh process: a disk hit vs cold)")
        sink.extend(disk.measure(model, args.quick))
        sink.extend(disk.pressure(model, args.quick))
    if "mlx-lm" in args.systems:
        _log(f"{model.name}: disk, mlx-lm's prompt cache file (saved, then a fresh process)")
        sink.extend(disk_peers.mlx_lm_file(model, args.quick))
    if found is None or isinstance(found.llama_server, llamacpp.Unavailable):
        return  # not asked for, or its skipped row comes from _llama_servers
    if model.gguf is None:
        return  # a tiny model: _llama_servers says why llama-server skips it
    _log(f"{model.name}: disk, llama-server's slot save/restore (then a fresh server)")
    sink.extend(disk_peers.llama_server_slots(model, args.quick, found.llama_server, found.threads))


def _llama_servers(found: llamacpp.Found, model: BenchModel, sink: Sink) -> list[ServerCommand]:
    """The llama.cpp servers to start on ``model``; a row (and a log line) for each that cannot."""
    commands = []
    for system in found.wanted():
        command = found.command(system, model)
        if isinstance(command, llamacpp.Unavailable):
            _log(f"{model.name}: {system} skipped: {command.reason}")
            sink.add(llamacpp.skipped(system, model, command))
        else:
            commands.append(command)
    return commands


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
