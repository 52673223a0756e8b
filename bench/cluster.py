"""Engines as Ray actors (``--scenarios cluster``; docs/cluster.md): what the process boundary
costs, and where requests land across replicas.

- ``cluster.{in_process,ray}.ttft_ms`` / ``.decode_ms_per_token``: one greedy stream on SmolLM2,
  in the host's process and in an engine process of its own on a local Ray, alternating, medians
  of the repetitions. TTFT is from ``generate`` to the first token; decode is the time from the
  first token to the last over the tokens after the first.
- ``cluster.{in_process,ray}.ttft_ms`` / ``.token_us`` on the ``simulated`` model (the hop
  rows' model): a model that computes nothing, so only the transport is timed: the time to the
  first token (the admission, the engine's reservation with its prefix lookup riding on it, and
  the first token cross the process boundary) and microseconds per streamed token over a long
  stream. ``cluster.ray_lookup_apart.*``: the same on Ray with the lookup asked after the grant
  (``lookup_with_reserve=False``, a round trip more), in the same run, for the ratio;
  ``cluster.ray_grant_apart.*``: with the grant and the lookup's answer in a Ray call each
  (``ClusterConfig.grant_with_lookup=False``, a crossing more), likewise. ``--ttft
  --grant-apart`` adds that third system to SmolLM2's TTFT rows.
- ``cluster.cached_fraction`` / ``cluster.chat_ttft_ms_p50``: a multi-session chat (sessions take
  turns two at a time, each turn its history plus a new line, sent without a session id so that
  only the prompt can tell where its cache is) on a model with two replicas, routed by exact
  prefix affinity (ours), round robin and power-of-two choices: the share of prompt tokens served
  from the cache, and the median time to first token. ``cluster.doc_cached_fraction`` /
  ``cluster.doc_chat_ttft_ms_p50``: the same where each session opens with its own ~500-token
  document (a chat about a pasted text), where the prefill a cache hit saves is most of a turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
import time
from collections.abc import AsyncIterator, Sequence

import anyio
import msgspec

from bench.results import OVERHEAD_MODEL, Measurement, timed
from runtime.cluster.options import ClusterConfig
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import ChatMessage, Finished, ModelSpec, TokensEmitted
from runtime.text.coalesce import CoalescePolicy

SYSTEM = "runtime"  # every row is ours; where the engine ran is in the scenario's name
KV_BUDGET_BYTES = 1 << 30
POLICIES = ("affinity", "round_robin", "power_of_two")
PER_TOKEN = CoalescePolicy(enabled=False)
PROMPT = "Write a short poem about the sea, the wind over it and the boats that sail home at dusk."
LINES = (
    "Tell me about the old harbour and the people who worked there.",
    "What did the fishermen eat before a long night at sea?",
    "Describe the lighthouse keeper's daily routine in winter.",
    "How did the town celebrate when the boats came back safely?",
    "What stories did the children hear about the reef?",
    "Which songs did the sailors sing while mending their nets?",
)


@dataclasses.dataclass(frozen=True)
class ClusterSizes:
    tokens: int = 64
    repetitions: int = 3
    overhead_tokens: int = 1000
    sessions: int = 6
    # 8 turns: 48 per workload, a first turn (no cache anywhere) in 8 rather than in 4, so that
    # the TTFT p50 falls among the turns routing decides rather than at the cold ones' edge.
    turns: int = 8
    reply_tokens: int = 8
    document_entries: int = 32  # the document chat's per-session document (~500 tokens)


CLUSTER_QUICK = ClusterSizes(
    tokens=16,
    repetitions=1,
    overhead_tokens=200,
    sessions=4,
    turns=2,
    reply_tokens=4,
    document_entries=8,
)


def measure(spec: ModelSpec, model: str, sizes: ClusterSizes) -> list[Measurement]:
    """Every cluster row for ``spec`` (a prepared model), reported under ``model``."""
    return anyio.run(_measure, spec, model, sizes)


@contextlib.asynccontextmanager
async def _local_ray(cpus: int = 2) -> AsyncIterator[None]:
    """A local Ray of ``cpus`` CPUs (Ray's count, for placing: each engine computes on the
    threads its own CPUs say) for the rows' runtimes to place their engines on."""
    from runtime.cluster.connect import connect

    link = await anyio.to_thread.run_sync(connect, ClusterConfig(num_cpus=cpus))
    try:
        yield
    finally:
        await anyio.to_thread.run_sync(link.close)


async def _measure(spec: ModelSpec, model: str, sizes: ClusterSizes) -> list[Measurement]:
    async with _local_ray(3):  # the overhead rows' three Ray engines, one CPU each
        out = await _overhead(sizes)
        out += await _transport(spec, model, sizes)
        return out + await _routing(spec, model, sizes)


async def _overhead_alone(sizes: ClusterSizes) -> list[Measurement]:
    async with _local_ray(3):
        return await _overhead(sizes)


async def _transport_alone(
    spec: ModelSpec, model: str, sizes: ClusterSizes, grant_apart: bool = False
) -> list[Measurement]:
    async with _local_ray(4 if grant_apart else 2):  # each Ray engine has 2 CPUs
        return await _transport(spec, model, sizes, grant_apart)


async def _routing_alone(spec: ModelSpec, model: str, sizes: ClusterSizes) -> list[Measurement]:
    async with _local_ray():
        return await _routing(spec, model, sizes)


def _config(ray: bool, engine_cpus: float = 1.0, grant_with_lookup: bool = True) -> RuntimeConfig:
    """``engine_cpus``: Ray sets an engine process's OMP_NUM_THREADS to its CPUs, and OpenBLAS
    (MLX's matmuls on a CPU) follows it: the lone engine of the transport rows gets both CPUs,
    the threads the in-process engine uses."""
    cluster = None
    if ray:
        cluster = ClusterConfig(engine_num_cpus=engine_cpus, grant_with_lookup=grant_with_lookup)
    # One host event per token: the first token is timed when it arrives, not when a chunk is full.
    return RuntimeConfig(kv_budget_bytes=KV_BUDGET_BYTES, cluster=cluster, coalesce=PER_TOKEN)


async def _transport(
    spec: ModelSpec, model: str, sizes: ClusterSizes, grant_apart: bool = False
) -> list[Measurement]:
    """SmolLM2 in-process and on Ray (and, ``grant_apart``, on Ray with the grant and the
    lookup's answer crossing in a call each), alternating."""
    configs = {"in_process": _config(False), "ray": _config(True, 2.0)}
    if grant_apart:
        configs["ray_grant_apart"] = _config(True, 2.0, grant_with_lookup=False)
    ttft: dict[str, list[float]] = {where: [] for where in configs}
    decode: dict[str, list[float]] = {where: [] for where in configs}
    async with contextlib.AsyncExitStack() as stack:
        runtimes = {}
        for where, config in configs.items():
            runtimes[where] = rt = await stack.enter_async_context(Runtime(config))
            await rt.load_model(spec)
        for repetition in range(sizes.repetitions + 1):  # the first is a warm-up
            for where, rt in runtimes.items():
                first, last, n = await _one_stream(rt, spec.name, repetition, sizes.tokens)
                if repetition:
                    ttft[where].append(first)
                    decode[where].append((last - first) / max(n - 1, 1))
    rows = []
    for where in configs:
        rows.append(timed(SYSTEM, model, f"cluster.{where}.ttft_ms", ttft[where]))
        rows.append(timed(SYSTEM, model, f"cluster.{where}.decode_ms_per_token", decode[where]))
    return rows


async def _overhead(sizes: ClusterSizes) -> list[Measurement]:
    """The transport alone: a simulated model with no compute cost, in-process and on Ray (with
    the prefix lookup riding on the reservation, asked apart after it, or riding on it with the
    grant and the answer crossing apart), alternating."""
    options = {"context_length": 1 << 15}
    spec = ModelSpec(name="sim", backend="simulated", options=options)
    apart = ModelSpec(name="sim", backend="simulated",
                      options={**options, "lookup_with_reserve": False})  # fmt: skip
    grant_apart = _config(True, grant_with_lookup=False)
    systems = {"in_process": (_config(False), spec), "ray": (_config(True), spec),
               "ray_lookup_apart": (_config(True), apart),
               "ray_grant_apart": (grant_apart, spec)}  # fmt: skip
    ttft: dict[str, list[float]] = {where: [] for where in systems}
    per_token: dict[str, list[float]] = {where: [] for where in systems}
    async with contextlib.AsyncExitStack() as stack:
        runtimes = {}
        for where, (config, model) in systems.items():
            runtimes[where] = rt = await stack.enter_async_context(Runtime(config))
            await rt.load_model(model)
        for repetition in range(sizes.repetitions * 5 + 1):
            for where, rt in runtimes.items():
                short = await _timed_stream(rt, "sim", f"s{repetition}", 1)
                long = await _timed_stream(rt, "sim", f"l{repetition}", sizes.overhead_tokens)
                if repetition:
                    ttft[where].append(short[0])
                    per_token[where].append((long[1] - long[0]) / max(long[2] - 1, 1))
    rows = []
    for where in systems:
        rows.append(timed(SYSTEM, OVERHEAD_MODEL, f"cluster.{where}.ttft_ms", ttft[where]))
        us = [round(t * 1e6, 2) for t in per_token[where]]
        rows.append(Measurement(SYSTEM, OVERHEAD_MODEL, f"cluster.{where}.token_us",
                                statistics.median(us), "us", us))  # fmt: skip
    return rows


async def _timed_stream(rt: Runtime, name: str, salt: str, tokens: int) -> tuple[float, float, int]:
    """(first token, last token, tokens) of one stream of a prompt, seconds from its start."""
    began = time.perf_counter()
    first = last = 0.0
    n = 0
    async with rt.generate(name, f"prompt {salt}", max_tokens=tokens, namespace=salt) as stream:
        async for event in stream:
            if isinstance(event, TokensEmitted):
                last = time.perf_counter() - began
                first = first or last
                n += len(event.token_ids)
    return first, last, n


async def _one_stream(rt: Runtime, name: str, salt: int, tokens: int) -> tuple[float, float, int]:
    began = time.perf_counter()
    first = last = 0.0
    n = 0
    # A namespace per run: every stream is cold, so both systems prefill the same prompt.
    ask = [ChatMessage(role="user", content=PROMPT)]
    stream = rt.generate(name, messages=ask, max_tokens=tokens, namespace=f"run{salt}")
    async with stream:
        async for event in stream:
            if isinstance(event, TokensEmitted):
                now = time.perf_counter() - began
                first = first or now
                last = now
                n += len(event.token_ids)
    return first, last, n


async def _routing(spec: ModelSpec, model: str, sizes: ClusterSizes) -> list[Measurement]:
    rows = []
    for policy in POLICIES:
        replicated = msgspec.structs.replace(spec, replicas=2, routing=policy)
        async with Runtime(_config(True)) as rt:
            await rt.load_model(replicated)
            for workload, entries in (("", 0), ("doc_", sizes.document_entries)):
                cached, prompt, ttfts = await _chat(rt, spec.name, sizes, entries)
                fraction = f"cluster.{workload}cached_fraction.{policy}"
                share = round(cached / prompt, 4)
                rows.append(Measurement(SYSTEM, model, fraction, share, "fraction"))
                scenario = f"cluster.{workload}chat_ttft_ms_p50.{policy}"
                rows.append(timed(SYSTEM, model, scenario, ttfts))
    return rows


def _document(session: int, entries: int) -> str:
    """Session ``session``'s own document of ``entries`` lines (~15 tokens each): a chat about a
    text the user pasted, as a chat app's or a provider's sessions often begin."""
    lines = (
        f"Entry {k} of log {session}: {LINES[(session + k) % len(LINES)]}" for k in range(entries)
    )
    return "Here is my log.\n" + "\n".join(lines) + "\n"


async def _chat(
    rt: Runtime, name: str, sizes: ClusterSizes, entries: int = 0
) -> tuple[int, int, list[float]]:
    """``sizes.sessions`` chats of ``sizes.turns`` turns, two sessions at a time; each opens with
    its own document of ``entries`` lines (0: none)."""
    opening = [_document(i, entries) if entries else "" for i in range(sizes.sessions)]
    histories = [
        [ChatMessage(role="user", content=f"Session {i}. {opening[i]}{LINES[i % len(LINES)]}")]
        for i in range(sizes.sessions)
    ]
    cached = prompt = 0
    ttfts: list[float] = []
    order = random.Random(7)

    async def turn(i: int, line: str) -> None:
        nonlocal cached, prompt
        began = time.perf_counter()
        first = 0.0
        text = []
        async with rt.generate(name, messages=histories[i], max_tokens=sizes.reply_tokens) as s:
            async for event in s:
                if isinstance(event, TokensEmitted | Finished):  # a reply may be empty
                    first = first or time.perf_counter() - began
                if isinstance(event, TokensEmitted):
                    text.append(event.text)
                elif isinstance(event, Finished):
                    cached += event.usage.cached_prompt_tokens
                    prompt += event.usage.prompt_tokens
        ttfts.append(first)
        histories[i] += [
            ChatMessage(role="assistant", content="".join(text)),
            ChatMessage(role="user", content=line),
        ]

    for t in range(sizes.turns):
        sessions = list(range(sizes.sessions))
        order.shuffle(sessions)  # who speaks when varies, as in a real service
        for pair in _pairs(sessions):
            async with anyio.create_task_group() as tg:
                for i in pair:
                    tg.start_soon(turn, i, LINES[(i + t + 1) % len(LINES)])
    return cached, prompt, ttfts


def _pairs(items: Sequence[int]) -> list[tuple[int, ...]]:
    seq = list(items)
    return [tuple(seq[i : i + 2]) for i in range(0, len(seq), 2)]


def plot(rows: Sequence[Measurement], path: str) -> None:
    """The routing rows as two panels (cached fraction, chat TTFT p50), each with the short chat
    and the document chat side by side, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    by = {r.scenario: r.value for r in rows}
    figure, panels = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.38
    for panel, (metric, title) in zip(
        panels,
        (
            ("cached_fraction", "prompt tokens served from cache"),
            ("chat_ttft_ms_p50", "TTFT p50 (ms)"),
        ),
        strict=True,
    ):
        for offset, (workload, label, colour) in enumerate(
            (("", "chat", "#9bd"), ("doc_", "document chat", "#2a7"))
        ):
            heights = [float(by.get(f"cluster.{workload}{metric}.{p}") or 0.0) for p in POLICIES]
            xs = [i + (offset - 0.5) * width for i in range(len(POLICIES))]
            panel.bar(xs, heights, width, label=label, color=colour)
        panel.set_xticks(range(len(POLICIES)), POLICIES)
        panel.set_title(title)
    panels[0].set_ylim(0, 1)
    panels[0].legend(loc="lower right", fontsize=8)
    figure.suptitle("2 replicas (Ray engines), multi-session chat, SmolLM2")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    """``python -m bench.cluster [--quick] [--overhead | --ttft [--grant-apart] | --routing]
    [--repetitions N] [--plot PATH]``: the rows for SmolLM2 (or the simulated transport's,
    SmolLM2's TTFT and decode in-process against Ray, or the routing's, alone), as JSON lines."""
    import sys

    from runtime.backends.model_source import prepare_model

    sizes = CLUSTER_QUICK if "--quick" in sys.argv else ClusterSizes()
    if "--repetitions" in sys.argv:
        repetitions = int(sys.argv[sys.argv.index("--repetitions") + 1])
        sizes = dataclasses.replace(sizes, repetitions=repetitions)
    if "--overhead" in sys.argv:  # the transport rows alone (no model to load, ~a minute)
        rows = anyio.run(_overhead_alone, sizes)
    elif "--ttft" in sys.argv:  # SmolLM2 in-process and on Ray, alternating, alone
        spec = ModelSpec(name="smollm2", path="smollm2-135m-instruct")
        prepare_model(spec)
        grant_apart = "--grant-apart" in sys.argv  # and on Ray with the merge off, paired
        rows = anyio.run(_transport_alone, spec, "smollm2", sizes, grant_apart)
    elif "--routing" in sys.argv:  # the routing rows alone
        spec = ModelSpec(name="smollm2", path="smollm2-135m-instruct")
        prepare_model(spec)
        rows = anyio.run(_routing_alone, spec, "smollm2", sizes)
    else:
        spec = ModelSpec(name="smollm2", path="smollm2-135m-instruct")
        prepare_model(spec)
        rows = measure(spec, "smollm2", sizes)
    for row in rows:
        print(msgspec.json.encode(row).decode())
    if "--plot" in sys.argv:
        plot(rows, sys.argv[sys.argv.index("--plot") + 1])


if __name__ == "__main__":
    main()
