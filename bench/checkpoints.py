"""Checkpoint memory (``--scenarios checkpoints``): what the checkpoints of one long prompt cost.

A model whose caches cannot be trimmed (sliding-window or recurrent layers) is reused from
checkpoints: snapshots taken during prefill. Ours snapshot only the layers that cannot be trimmed
and restore the full-attention layers by cutting back the final state (reuse.md). The baseline is
what mlx-lm gives a host: ``copy.deepcopy`` of the whole prompt cache at each checkpoint (how
``mlx_lm.server`` keeps prompt caches), at the same token counts.

- ``ckpt.points``: checkpoints the runtime kept for the prompt (every ``spacing`` tokens, at most
  ``EVERY`` apart, and len - 1; see actors/engine/checkpoints.py).
- ``ckpt.bytes``: bytes of those checkpoints, beyond the final state itself (MiB).
- ``ckpt.whole/ours``: the baseline's bytes over ours (how many times less memory ours use).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from actors.engine.checkpoints import CheckpointPolicy, plan_checkpoints
from bench.models import Scaled
from bench.prompts import encode, make_text
from bench.results import Measurement, ratio
from runtime.backends.mlx.backend import MlxBackend
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Finished, ModelSpec

# Prompt tokens (the tiny models' context is 2048); a quick run on a real model keeps two points.
PROMPT_TOKENS = Scaled(tiny=1536, tiny_quick=1536, real=1536, real_quick=300)
EVERY = 256
CHUNK = 256
MIB = 1 << 20
BUDGET = 4 << 30


async def _ours(path: Path, name: str, prompt: list[int]) -> tuple[int, int, int]:
    """(points, bytes of their snapshots, snapshots not in an entry) after one generate."""
    spec = ModelSpec(
        name=name,
        path=str(path),
        backend="mlx",
        prefill_chunk_tokens=CHUNK,
        options={"checkpoint_every_tokens": EVERY},
    )
    async with Runtime(RuntimeConfig(kv_budget_bytes=BUDGET)) as rt:
        await rt.load_model(spec)
        result = await rt.complete(name, prompt_tokens=tuple(prompt), max_tokens=1)
        if not isinstance(result.terminal, Finished):
            raise RuntimeError(f"the checkpoint prompt did not finish: {result.terminal}")
        engine = next(s for a, s in rt.stats().actors.items() if a.startswith(f"engine:{name}#"))
        gauges = engine.gauges
        return gauges["entry_points"], gauges["entry_point_bytes"], gauges["pending_snapshots"]


def _whole_copies(model: Any, prompt: list[int], points: list[int]) -> int:
    """Bytes of deep copies of mlx-lm's prompt cache at ``points`` during a chunked prefill."""
    cache = mlx_cache.make_prompt_cache(model)
    copies = 0
    done = 0
    for end in [*points, len(prompt)]:
        while done < end:
            step = min(CHUNK, end - done)
            model(mx.array([prompt[done : done + step]]), cache=cache)
            mx.eval([c.state for c in cache])
            done += step
        if end < len(prompt):
            snapshot = copy.deepcopy(cache)
            copies += sum(int(c.nbytes) for c in snapshot if not c.empty())
    return copies


def measure(
    path: Path, model: Any, tokenizer: Any, name: str, prompt_tokens: int
) -> list[Measurement]:
    prompt = encode(tokenizer, make_text(tokenizer, prompt_tokens, seed=7))[:prompt_tokens]
    n_points, ours, pending = anyio.run(_ours, path, name, prompt)
    if n_points == 0:  # trimmable: reuse cuts the one entry back, no checkpoint exists
        note = "every layer trims: no checkpoints"
        return [Measurement("runtime", name, "ckpt.points", 0, "count", note=note)]
    # The very points the engine planned (same function, same inputs).
    # The engine's rule for this model (its measured layout, the budget) and the same planner.
    spec = ModelSpec(name=name, path=str(path), backend="mlx")
    info = MlxBackend.load(spec).info
    free = BUDGET - info.kv_bytes(len(prompt) + 1, CHUNK)
    rule = CheckpointPolicy(EVERY, BUDGET).rule(info, len(prompt), 0, free)
    assert rule is not None, "a model that checkpoints has a rule"
    points = plan_checkpoints(prompt, 0, len(prompt), tokenizer.decode, rule)
    assert (n_points, pending) == (len(points), 0), "the runtime kept other points"
    whole = _whole_copies(model, prompt, points)
    return [
        Measurement("runtime", name, "ckpt.points", n_points, "count"),
        Measurement("mlx-lm", name, "ckpt.points", len(points), "count"),
        Measurement("runtime", name, "ckpt.bytes", round(ours / MIB, 3), "MiB"),
        Measurement("mlx-lm", name, "ckpt.bytes", round(whole / MIB, 3), "MiB"),
        ratio("runtime", name, "ckpt.whole/ours", whole, ours),
    ]
