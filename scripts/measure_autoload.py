"""What auto-load costs the first request: TTFT of a request for the default model after its
keep-alive unloaded it (the request loads it again) vs TTFT of a request to the loaded model.

The runtime is embedded (no HTTP); the model has ``keep_alive_s=0``, so it is idle again after
each cold request; then it is loaded with no keep-alive for the warm rounds. Each round's prompt
is new (no prefix to reuse). Prints the medians and their ratio. Not a test (docs/http.md).

    PYTHONPATH=. LD_PRELOAD=... .venv/bin/python scripts/measure_autoload.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import msgspec

from runtime.backends.model_source import default_model_spec, prepare_model, prepared_spec
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import TokensEmitted
from runtime.testing.harness import wait_until
from runtime.text.coalesce import CoalescePolicy


async def _ttft(rt: Runtime, prompt: str) -> float:
    start = time.perf_counter()
    no_coalescing = CoalescePolicy(enabled=False)  # the first token's own event
    async with rt.generate("m", prompt, max_tokens=4, coalesce=no_coalescing) as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted):
                return time.perf_counter() - start
    raise RuntimeError("the request produced no token")


async def _measure(rounds: int) -> tuple[list[float], list[float]]:
    spec = default_model_spec("m")
    spec = msgspec.structs.replace(prepared_spec(spec, prepare_model(spec)), keep_alive_s=0.0)
    cold: list[float] = []
    warm: list[float] = []
    async with Runtime(RuntimeConfig(kv_budget_bytes=256 << 20)) as rt:

        def idle() -> bool:
            return rt.stats().actors["router"].gauges["models_idle"] == 1

        await rt.load_model(spec)
        for i in range(rounds):
            await wait_until(rt, idle, 120)
            cold.append(await _ttft(rt, f"Count to {i}: one, two,"))
        await wait_until(rt, idle, 120)
        await rt.load_model(msgspec.structs.replace(spec, keep_alive_s=None))
        for i in range(rounds):
            warm.append(await _ttft(rt, f"List {i} colours:"))
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cold, warm = anyio.run(_measure, args.rounds, backend_options={"use_uvloop": True})
    c, w = statistics.median(cold), statistics.median(warm)
    print(
        f"TTFT median: auto-load {c * 1000:.0f} ms, loaded {w * 1000:.0f} ms, "
        f"ratio {c / w:.1f}x ({args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
