"""``python -m bench``: our runtime vs raw mlx-lm vs ``mlx_lm.server`` on the same models.

Prints one JSON object per measurement (to stdout, or to ``--json PATH``), then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Sequence
from typing import IO

from bench import (
    batching,
    checkpoints,
    cluster,
    environment,
    generation,
    hop,
    ours,
    over_http,
    raw_mlx,
    server,
    structured,
)
from bench.models import MODELS, load_bench_model
from bench.results import Sink, format_table
from bench.workload import SIZES, build_workload
from runtime.messages import ModelSpec

SCENARIO_GROUPS = (
    "existing",
    "generation",
    "checkpoints",
    "batching",
    "structured",
    *over_http.GROUPS,
    "hop",
    "cluster",
)
MODEL_FREE_GROUPS = {"hop"}
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
        default="runtime,mlx-lm,mlx_lm.server",
        help="comma-separated subset of: runtime, mlx-lm, mlx_lm.server",
    )
    parser.add_argument(
        "--scenarios",
        default=",".join(SCENARIO_GROUPS),
        help="comma-separated subset of: existing (turn2, abandon, decode), generation "
        "(gen.*: one-stream decode, 4 concurrent, inter-token latency, coalescing; runtime "
        "and mlx-lm only), checkpoints (ckpt.*: memory of a long prompt's checkpoints, runtime "
        "vs deep copies of mlx-lm's prompt cache), batching (batch.*: decode tokens/s of one "
        "sequence alone vs four in a DecodeBatch, backend level), structured (structured.*: "
        "decode ms/token under a JSON Schema vs none, runtime); over HTTP, mlxrt serve vs "
        "mlx_lm.server: concurrency (1/2/4/8 streams at once), keystroke (a completion per "
        "keystroke, each superseding the last), prewarm (TTFT after a prewarm vs cold), branch "
        "(TTFT and tokens re-processed when ~900/~1,800 tokens of notes are re-sent with their "
        "last line changed); hop "
        "(hop.*: the actor message hop and the runtime's cost per streamed token, no model); "
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
    args.systems = set(args.systems.split(","))
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
        sink.meta(environment.describe("quick" if args.quick else "full"))
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
            if "structured" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: constrained decoding (a JSON Schema vs none, runtime)")
                rounds = structured.ROUNDS.pick(loaded, args.quick)
                sink.extend(structured.measure(path, kind, rounds))
            if "batching" in args.scenarios and "runtime" in args.systems:
                _log(f"{kind}: backend-level batching (B=1 loop vs a DecodeBatch of four)")
                batch_sizes = batching.BATCH_SIZES.pick(loaded, args.quick)
                sink.extend(batching.measure(path, tokenizer, kind, batch_sizes))
            if "cluster" in args.scenarios and "runtime" in args.systems and loaded.real and RAY:
                _log(f"{kind}: cluster (a Ray engine vs in-process; routing across 2 replicas)")
                spec = ModelSpec(name=kind, path=str(path))
                sizes = cluster.CLUSTER_QUICK if args.quick else cluster.ClusterSizes()
                sink.extend(cluster.measure(spec, kind, sizes))
            http_groups = [group for group in over_http.GROUPS if group in args.scenarios]
            if http_groups:
                _log(f"{kind}: {', '.join(http_groups)} (mlxrt serve vs mlx_lm.server, over HTTP)")
                sink.extend(over_http.measure(loaded, http_groups, args.systems, args.quick))
            if "existing" not in args.scenarios:
                continue
            work = build_workload(tokenizer, SIZES.pick(loaded, args.quick))
            if "mlx-lm" in args.systems:
                _log(f"{kind}: raw mlx-lm")
                sink.extend(raw_mlx.measure(model, kind, work))
            if "runtime" in args.systems:
                _log(f"{kind}: runtime")
                sink.extend(ours.measure(path, kind, work))
            if "mlx_lm.server" in args.systems:
                _log(f"{kind}: mlx_lm.server")
                sink.extend(server.measure(path, kind, work))
    mode = "quick" if args.quick else "full"
    print(f"\n# bench ({mode}; {time.perf_counter() - began:.0f}s)", file=sys.stderr)
    print(format_table(sink.items), file=sys.stdout if args.json else sys.stderr)
    release_thread_resources()  # raw mlx-lm ran on this thread: MLX needs its streams cleared
    return 0


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
