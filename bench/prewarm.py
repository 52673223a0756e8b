"""Prewarm (``--scenarios prewarm``): the first request's TTFT after its prompt was prewarmed.

A client that knows its prompt before it asks (a document opened, a form being filled) can have
it prefilled ahead. Ours: ``POST /v1/prewarm`` with the prompt and a ``session``, answered once
the state is cached; the request follows in the same session. ``mlx_lm.server`` has no prewarm:
the closest a user can do is the same prompt with ``max_tokens: 1`` beforehand, which leaves its
cache in the server's prompt cache. Cold is a fresh prompt of the same size on the same server.

- ``prewarm.cold_ttft`` / ``prewarm.after_ttft``: TTFT of a streamed greedy request (ms).
- ``prewarm.cold/after``: the ratio of the two medians (higher is better).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from bench.http_client import Reply, Server, complete, in_turn, post_json, speaks_our_api
from bench.models import BenchModel, Scaled
from bench.prompts import make_text
from bench.results import Measurement, ratio, timed


@dataclass(frozen=True)
class PrewarmSizes:
    prompt_tokens: int = 500
    max_tokens: int = 8
    repetitions: int = 5


SIZES = Scaled(
    tiny=PrewarmSizes(),
    tiny_quick=PrewarmSizes(repetitions=1),
    real=PrewarmSizes(repetitions=3),
    real_quick=PrewarmSizes(prompt_tokens=100, repetitions=1),
)


async def _after_prewarm(server: Server, prompt: str, max_tokens: int, session: str) -> Reply:
    """The request for ``prompt`` once ``server``'s way of prewarming it has finished."""
    if speaks_our_api(server.system):
        body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens}
        await post_json(server, "/v1/prewarm", {**body, "session": session})
        return await complete(server, prompt, max_tokens, extra={"session": session})
    await complete(server, prompt, 1)
    return await complete(server, prompt, max_tokens)


async def measure(servers: Sequence[Server], model: BenchModel, quick: bool) -> list[Measurement]:
    """Cold and prewarmed TTFT on every server, the servers taking turns to go first."""
    sizes = SIZES.pick(model, quick)
    cold: dict[str, list[float]] = {server.system: [] for server in servers}
    after: dict[str, list[float]] = {server.system: [] for server in servers}
    cached: dict[str, list[int | None]] = {server.system: [] for server in servers}
    for rep in range(sizes.repetitions):
        fresh = make_text(model.tokenizer, sizes.prompt_tokens, 30000 + rep)
        known = make_text(model.tokenizer, sizes.prompt_tokens, 31000 + rep)
        for server in in_turn(servers, rep):
            cold[server.system].append((await complete(server, fresh, sizes.max_tokens)).ttft)
            reply = await _after_prewarm(server, known, sizes.max_tokens, f"prewarm-{rep}")
            after[server.system].append(reply.ttft)
            cached[server.system].append(reply.cached_tokens)
    rows = []
    for system in cold:
        cold_m = timed(system, model.name, "prewarm.cold_ttft", cold[system])
        after_m = timed(system, model.name, "prewarm.after_ttft", after[system])
        how = (
            "over HTTP (mlxrt serve), POST /v1/prewarm then the request, one session"
            if speaks_our_api(system)
            else "no prewarm API: the same prompt with max_tokens 1 first"
        )
        note = (
            f"{how}; {sizes.prompt_tokens}-token prompts, max_tokens {sizes.max_tokens}; "
            f"cached_tokens after: {cached[system]}"
        )
        rows += [
            cold_m,
            replace(after_m, note=note),
            ratio(system, model.name, "prewarm.cold/after", cold_m.value, after_m.value),
        ]
    return rows
