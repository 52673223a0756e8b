"""``python -m bench``: our runtime vs raw mlx-lm vs ``mlx_lm.server`` on the same tiny models.

Prints one JSON object per measurement (to stdout, or to ``--json PATH``), then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Sequence
from typing import IO

from bench import ours, raw_mlx, server
from bench.results import Sink, format_table
from bench.workload import QUICK, Sizes, build_workload

KINDS = ("llama", "sliding", "hybrid")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--models", default=",".join(KINDS), help="comma-separated tiny kinds")
    parser.add_argument("--quick", action="store_true", help="shorter prompts, 1 repetition")
    parser.add_argument("--json", metavar="PATH", help="write JSON lines here, not to stdout")
    parser.add_argument(
        "--systems",
        default="runtime,mlx-lm,mlx_lm.server",
        help="comma-separated subset of: runtime, mlx-lm, mlx_lm.server",
    )
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = set(args.models) - set(KINDS)
    if unknown:
        parser.error(f"unknown model kinds {sorted(unknown)}; choose from {KINDS}")
    args.systems = set(args.systems.split(","))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    from runtime.actor import release_thread_resources
    from runtime.testing.tiny_models import load_tiny_model, tiny_model_path

    args = _parse(argv)
    sizes = QUICK if args.quick else Sizes()
    began = time.perf_counter()
    with contextlib.ExitStack() as stack:
        out: IO[str] = sys.stdout
        if args.json:
            out = stack.enter_context(open(args.json, "w", encoding="utf-8"))
        sink = Sink(out)
        for kind in args.models:
            path = tiny_model_path(kind)
            model, tokenizer = load_tiny_model(kind)
            work = build_workload(tokenizer, sizes)
            _log(f"{kind}: {path}")
            if "mlx-lm" in args.systems:
                _log(f"{kind}: raw mlx-lm")
                sink.extend(raw_mlx.measure(model, kind, work))
            if "runtime" in args.systems:
                _log(f"{kind}: runtime")
                sink.extend(ours.measure(path, kind, work))
            if "mlx_lm.server" in args.systems:
                _log(f"{kind}: mlx_lm.server")
                sink.extend(server.measure(path, kind, work))
    mode = "quick" if args.quick else f"median of {sizes.repetitions}"
    print(f"\n# bench ({mode}; {time.perf_counter() - began:.0f}s)", file=sys.stderr)
    print(format_table(sink.items), file=sys.stdout if args.json else sys.stderr)
    release_thread_resources()  # raw mlx-lm ran on this thread: MLX needs its streams cleared
    return 0


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
