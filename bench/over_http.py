"""The groups measured over HTTP (concurrency, prewarm, branch, keystroke): all servers at once.

For one model, ``mlxrt serve`` (system "runtime") and ``mlx_lm.server`` run at once, started by
the same launcher on the same weights directory, with the llama.cpp servers on the GGUF file
those weights came from (bench/llamacpp.py). Each group drives them all through the same client
with the same prompts and ``max_tokens``, the servers taking turns to go first. An idle server
waits on a socket meanwhile, so no two compute at the same time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from bench import branch, concurrency, keystroke, prewarm
from bench.http_client import RequestFailed, Server, complete
from bench.models import BenchModel
from bench.prompts import make_text
from bench.results import Measurement
from bench.serving import ServerCommand, ServerUnavailable, mlx_lm_server, mlxrt_serve, running

Group = Callable[[Sequence[Server], BenchModel, bool], Awaitable[list[Measurement]]]
# In this order: keystroke last, as it drops streams mid-request, the pattern likeliest to break
# a server (it broke mlx_lm.server 0.32.2, see keystroke.TYPOS), which would fail the groups after.
GROUPS: dict[str, Group] = {
    "concurrency": concurrency.measure,
    "prewarm": prewarm.measure,
    "branch": branch.measure,
    "keystroke": keystroke.measure,
}


def commands(model: BenchModel, systems: set[str]) -> list[ServerCommand]:
    """The MLX servers to start for ``systems`` (raw mlx-lm has no server: it has no rows here)."""
    wanted = []
    if "runtime" in systems:
        wanted.append(mlxrt_serve(model.path, model.name))
    if "mlx_lm.server" in systems:
        wanted.append(mlx_lm_server(model.path))
    return wanted


def measure(
    model: BenchModel,
    groups: Sequence[str],
    systems: set[str],
    quick: bool,
    others: Sequence[ServerCommand] = (),
) -> list[Measurement]:
    """Every group in ``groups`` on every server of ``systems`` and ``others`` (the llama.cpp
    servers that can run), or a row per server saying why none could be measured."""
    wanted = [*commands(model, systems), *others]
    if not wanted:
        return []
    try:
        with running(wanted) as servers:
            return asyncio.run(_measure(servers, model, groups, quick))
    except (ServerUnavailable, RequestFailed, OSError, TimeoutError) as exc:
        reason = f"skipped {', '.join(groups)}: {type(exc).__name__}: {exc}"
        return [
            Measurement(command.system, model.name, "skipped", None, "-", note=reason)
            for command in wanted
        ]


async def _measure(
    servers: Sequence[Server], model: BenchModel, groups: Sequence[str], quick: bool
) -> list[Measurement]:
    warmup = make_text(model.tokenizer, 16, 29000)
    for server in servers:  # mlx_lm.server builds its generator on the first request
        await complete(server, warmup, 2)
    rows: list[Measurement] = []
    for group in groups:
        rows += await GROUPS[group](servers, model, quick)
    return rows
