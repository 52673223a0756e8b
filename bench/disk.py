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
- ``disk.cached_tokens``: what the hit reused (all but the last prompt token).
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
