"""The prefix cache's disk tier (``--scenarios disk``): a 2,000-token prompt in a fresh process.

Each measurement is a process of its own (``runtime.testing.disk_child``), so nothing of an
earlier run is in RAM: a first process on an empty folder prefills the prompt cold and, leaving,
writes its entries; a second process on that folder sends the same prompt and is served from
disk. Time to first token is measured from sending the request (the model already loaded).

- ``disk.cold_ttft``, ``disk.hit_ttft`` (s): the two processes' TTFT, median of ``rounds``;
- ``disk.hit/cold`` (x): the goal is 0.1 or less (issue 26);
- ``disk.load_mb_per_s``: the entry's bytes over the disk tier's load time (read, checked,
  imported), against the disk's own read rate (``disk.read_mb_per_s``: the same file read
  straight after a page-cache drop is not possible without root; this reads it once, cold or
  warm as the system left it, as a ceiling);
- ``disk.cached_tokens``: what the hit reused (all but the last prompt token);
- ``disk.pressure_cached_ram`` / ``disk.pressure_cached_disk``: more sessions than the KV budget
  holds each send a document, then come back to it: the fraction of the second round's prompt
  tokens served from a cache, RAM only against RAM and the disk tier (one process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.models import BenchModel, Scaled
from bench.prompts import encode, make_text
from bench.results import Measurement, ratio, timed

SYSTEM = "runtime"
PROMPT_TOKENS = Scaled(tiny=1900, tiny_quick=1900, real=2000, real_quick=2000)
ROUNDS = Scaled(tiny=3, tiny_quick=1, real=2, real_quick=1)
MAX_TOKENS = 4
ROOT = Path(__file__).resolve().parent.parent


def _child(directory: Path, model_path: Path, prompt_file: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "runtime.testing.disk_child", str(directory), str(model_path),
         str(prompt_file), str(MAX_TOKENS)],
        cwd=ROOT, capture_output=True, text=True, check=True, timeout=1800,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(model: BenchModel, quick: bool) -> list[Measurement]:
    n = PROMPT_TOKENS.pick(model, quick)
    prompt = encode(model.tokenizer, make_text(model.tokenizer, n, seed=26))[:n]
    cold, hit, load_rates, read_rates, cached = [], [], [], [], []
    for _ in range(ROUNDS.pick(model, quick)):
        with tempfile.TemporaryDirectory() as folder:
            directory = Path(folder) / "cache"
            prompt_file = Path(folder) / "prompt.json"
            prompt_file.write_text(json.dumps(prompt))
            first = _child(directory, model.path, prompt_file)
            second = _child(directory, model.path, prompt_file)
            if first["tier"] != "cold" or second["tier"] != "disk":
                raise RuntimeError(f"disk bench: expected cold then disk, got {first} {second}")
            cold.append(first["ttft_s"])
            hit.append(second["ttft_s"])
            cached.append(float(second["cached_tokens"]))
            files = list(directory.rglob("*.safetensors"))
            size = sum(f.stat().st_size for f in files)
            if second["disk_load_ms"]:
                load_rates.append(size / 2**20 / (second["disk_load_ms"] / 1000))
            began = time.perf_counter()
            for f in files:
                f.read_bytes()
            read_rates.append(size / 2**20 / max(time.perf_counter() - began, 1e-9))
    name = model.name
    cold_m = timed(SYSTEM, name, "disk.cold_ttft", cold, unit="s")
    hit_m = timed(SYSTEM, name, "disk.hit_ttft", hit, unit="s")
    return [
        cold_m,
        hit_m,
        ratio(SYSTEM, name, "disk.hit/cold", hit_m.value, cold_m.value),
        Measurement(SYSTEM, name, "disk.cached_tokens", max(cached), "tokens", cached),
        Measurement(SYSTEM, name, "disk.load_mb_per_s", _median(load_rates), "MB/s", load_rates),
        Measurement(SYSTEM, name, "disk.read_mb_per_s", _median(read_rates), "MB/s", read_rates),
    ]


def _median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return round(ordered[len(ordered) // 2], 1) if ordered else None


# More sessions than the KV budget holds: each sends its own document, then comes back to it.
SESSIONS = Scaled(tiny=8, tiny_quick=6, real=6, real_quick=4)
DOCUMENT_TOKENS = Scaled(tiny=600, tiny_quick=400, real=500, real_quick=300)
HELD = 2.5  # the KV budget holds about this many sessions' KV


def pressure(model: BenchModel, quick: bool) -> list[Measurement]:
    """``disk.pressure_cached_ram`` / ``disk.pressure_cached_disk``: the fraction of the second
    round's prompt tokens served from a cache, with RAM only and with the disk tier."""
    import anyio

    n, size = SESSIONS.pick(model, quick), DOCUMENT_TOKENS.pick(model, quick)
    documents = [
        encode(model.tokenizer, make_text(model.tokenizer, size, seed=100 + s))[:size]
        for s in range(n)
    ]
    follow_up = encode(model.tokenizer, make_text(model.tokenizer, 24, seed=99))[:24]
    fractions: dict[str, float] = {}
    for mode in ("ram", "disk"):
        with tempfile.TemporaryDirectory() as folder:
            fractions[mode] = anyio.run(_pressure_run, model, documents, follow_up, mode, folder)
    return [
        Measurement(SYSTEM, model.name, "disk.pressure_cached_ram", fractions["ram"], "fraction"),
        Measurement(SYSTEM, model.name, "disk.pressure_cached_disk", fractions["disk"], "fraction"),
    ]


async def _pressure_run(
    model: BenchModel, documents: list[list[int]], follow_up: list[int], mode: str, folder: str
) -> float:
    from runtime.backends.disk import DiskCacheConfig
    from runtime.backends.mlx.backend import MlxBackend
    from runtime.host.api import Runtime
    from runtime.host.config import RuntimeConfig
    from runtime.messages import ModelSpec

    spec = ModelSpec(name=model.name, path=str(model.path))
    info = MlxBackend.load(spec).info
    one = info.kv_bytes(len(documents[0]) + len(follow_up) + MAX_TOKENS, 256)
    # A checkpointing model's snapshot room is at most 1/32 of the budget (checkpoints.py).
    disk = DiskCacheConfig(directory=folder) if mode == "disk" else None
    config = RuntimeConfig(kv_budget_bytes=int(one * HELD * 32 / 31), disk_cache=disk)
    cached = total = 0
    async with Runtime(config) as rt:
        await rt.load_model(spec)
        for document in documents:  # round one: every session reads its document
            await rt.complete(model.name, prompt_tokens=document, max_tokens=MAX_TOKENS)
        for document in documents:  # round two: each comes back with a question
            prompt = document + follow_up
            result = await rt.complete(model.name, prompt_tokens=prompt, max_tokens=MAX_TOKENS)
            assert result.started is not None
            cached += result.started.cached_tokens
            total += len(prompt)
    return round(cached / total, 3)
