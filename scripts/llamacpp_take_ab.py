"""Taking a cached entry in place against copying it, on the llama.cpp backend (issue 22).

In one process, alternating: a branch near the end of a long prompt (notes, then the same notes
with another question) and a turn 2 (a first turn, its reply and a follow-up), each with the
engine's take policy as it is and with taking turned off (``gate.take_within`` patched to -1,
so every restore copies). Prints the TTFT medians (take over copy) and the time of the restore's
cut itself (``take_state`` against ``copy_state``). Not a test: compare the ratios of one run.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 PYTHONPATH=. \\
        .venv/bin/python scripts/llamacpp_take_ab.py --model smollm2 --tokens 1800 --reps 4

``--no-extra-bufts``: load without llama.cpp's extra buffer types (AMX, repacked weights), for a
machine whose AMX kernel crashes (docs/models.md); ``--threads``: llama.cpp's threads.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import anyio

import actors.engine.gate as gate
import runtime.backends.llamacpp.binding as binding
from bench.branch import QUESTIONS, make_notes
from runtime.backends.llamacpp.backend import LlamaCppBackend
from runtime.backends.options import TAKE_TAIL_TOKENS
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ModelSpec, Started, TokensEmitted

GGUF = Path.home() / ".cache/mlx-actor-runtime/gguf"
MODELS = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
TAKE = gate.take_within
CUT = {"ms": 0.0}


def time_cuts() -> None:
    for name in ("copy_state", "take_state"):
        real = getattr(LlamaCppBackend, name)

        def timed(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(*args, **kwargs)
            finally:
                CUT["ms"] += 1000 * (time.perf_counter() - start)

        setattr(LlamaCppBackend, name, timed)


def no_extra_bufts() -> None:
    real = binding.import_llama_cpp

    class Lib:
        def __init__(self, lib: Any) -> None:
            self._lib = lib

        def __getattr__(self, name: str) -> Any:
            return getattr(self._lib, name)

        def llama_model_load_from_file(self, path: Any, params: Any) -> Any:
            params.use_extra_bufts = False
            return self._lib.llama_model_load_from_file(path, params)

    binding.import_llama_cpp = lambda: Lib(real())


class ApproxTokens:
    """make_notes only needs a length: ~4.3 characters a token."""

    def encode(self, text: str, add_special_tokens: bool = False) -> range:
        return range(int(len(text) / 4.3))


async def run(rt: Runtime, prompt: str, max_tokens: int) -> tuple[float, Started, str, float]:
    CUT["ms"] = 0.0
    start, first, started, text = time.perf_counter(), None, None, []
    async with rt.generate("m", prompt=prompt, max_tokens=max_tokens) as stream:
        async for event in stream:
            if isinstance(event, Started):
                started = event
            if isinstance(event, TokensEmitted):
                first = first or 1000 * (time.perf_counter() - start)
                text.append(event.text)
    assert first is not None
    assert started is not None
    return first, started, "".join(text), CUT["ms"]


async def measure(args: argparse.Namespace) -> None:
    rows: dict[tuple[str, bool], list[tuple[float, float, int]]] = {}
    spec = ModelSpec(
        name="m",
        backend="llamacpp",
        path=str(GGUF / MODELS[args.model]),
        options={"n_threads": args.threads, "take_tail_tokens": TAKE_TAIL_TOKENS},
    )
    async with Runtime(RuntimeConfig(kv_budget_bytes=2 << 30)) as rt:
        await rt.load_model(spec)
        for rep in range(args.reps):
            for take in (True, False) if rep % 2 == 0 else (False, True):
                gate.take_within = TAKE if take else (lambda info: -1)
                notes = make_notes(ApproxTokens(), args.tokens, 50000 + 10 * rep + take)
                first, second = (f"{notes}\n{question}" for question in QUESTIONS)
                await run(rt, first, 8)
                await anyio.sleep(0.3)
                ttft, started, _, cut = await run(rt, second, 8)
                assert started.taken == take, started
                redone = started.prompt_tokens - started.cached_tokens
                rows.setdefault(("branch", take), []).append((ttft, cut, redone))
                await anyio.sleep(0.3)
                turn1 = f"{notes}\nQuestion: what is the first note about?\nAnswer:"
                _, _, reply, _ = await run(rt, turn1, 16)
                await anyio.sleep(0.3)
                turn2 = f"{turn1}{reply}\nQuestion: and the last one?\nAnswer:"
                ttft, started, _, cut = await run(rt, turn2, 1)
                assert started.taken == take, started
                redone = started.prompt_tokens - started.cached_tokens
                rows.setdefault(("turn2", take), []).append((ttft, cut, redone))
                await anyio.sleep(0.3)
    gate.take_within = TAKE
    for kind in ("branch", "turn2"):
        took, copied = rows[(kind, True)], rows[(kind, False)]
        t, c = (statistics.median(r[0] for r in rs) for rs in (took, copied))
        ct, cc = (statistics.median(r[1] for r in rs) for rs in (took, copied))
        print(
            f"{args.model} ~{args.tokens} {kind}: TTFT take {t:.1f} / copy {c:.1f} ms = "
            f"{t / c:.3f}x; the cut: take {ct:.2f} ms, copy {cc:.2f} ms; re-processed "
            f"{[r[2] for r in took]} / {[r[2] for r in copied]}"
        )
        print(f"  take {[round(r[0], 1) for r in took]}  copy {[round(r[0], 1) for r in copied]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--tokens", type=int, default=1800)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-extra-bufts", action="store_true")
    args = parser.parse_args()
    if args.no_extra_bufts:
        no_extra_bufts()
    time_cuts()
    anyio.run(measure, args)


if __name__ == "__main__":
    main()
