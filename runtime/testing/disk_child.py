"""One generate in a process of its own, with the disk tier on: what a restart finds.

``python -m runtime.testing.disk_child DIR MODEL_PATH PROMPT_JSON [MAX_TOKENS [BACKEND]]`` loads
the model (an mlx-lm directory, or with BACKEND ``llamacpp`` a GGUF file), sends the prompt's
tokens once and prints one JSON line: the reuse tier, cached tokens, prompt tokens, the output
tokens, the seconds from sending to the first token, and the disk tier's load milliseconds and
bytes.
Leaving the Runtime unloads the model, which writes what RAM holds to the disk tier. Used by
tests/test_disk_tier.py and tests/test_llamacpp_disk.py (a real second process) and the bench's
``disk`` group.
"""

from __future__ import annotations

import json
import sys
import time

import anyio

from runtime.backends.disk import DiskCacheConfig
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import Finished, ModelSpec, Started, TokensEmitted


async def run(
    directory: str, model_path: str, prompt: list[int], max_tokens: int, backend: str = "mlx"
) -> dict[str, object]:
    config = RuntimeConfig(disk_cache=DiskCacheConfig(directory=directory))
    async with Runtime(config) as rt:
        loaded = await rt.load_model(ModelSpec(name="m", backend=backend, path=model_path))
        tokens: list[int] = []
        started: Started | None = None
        first: float | None = None
        sent = time.perf_counter()
        async with rt.generate("m", prompt_tokens=prompt, max_tokens=max_tokens) as stream:
            async for event in stream:
                if isinstance(event, Started):
                    started = event
                elif isinstance(event, TokensEmitted):
                    first = first or time.perf_counter()
                    tokens.extend(event.token_ids)
                elif isinstance(event, Finished):
                    break
        engine = rt.stats().actors[f"engine:m#{loaded.epoch}"]
    assert started is not None
    return {
        "tier": str(started.tier),
        "cached_tokens": started.cached_tokens,
        "prompt_tokens": started.prompt_tokens,
        "tokens": tokens,
        "ttft_s": (first or time.perf_counter()) - sent,
        "disk_load_ms": engine.counters.get("disk_load_ms", 0),
        "disk_bytes": engine.gauges.get("disk_bytes", 0),
    }


def main() -> None:
    directory, model_path, prompt_json = sys.argv[1:4]
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    backend = sys.argv[5] if len(sys.argv) > 5 else "mlx"
    with open(prompt_json) as f:
        prompt = [int(t) for t in json.load(f)]
    print(json.dumps(anyio.run(run, directory, model_path, prompt, max_tokens, backend)))


if __name__ == "__main__":
    main()
