"""Runtime overhead (``--scenarios hop``): the actor message hop, and the cost per streamed token.

No model: both run under uvloop, as ``mlxrt`` and the demo do.

- ``hop.message_us_p50`` / ``hop.message_us_p90``: two actors of one ``ActorSystem`` pass a message
  back and forth; one hop is the time from one actor's ``handle`` to the other's, so it holds the
  sender's mailbox loop, a task switch and the receiver's mailbox loop.
- ``hop.token_us``: a ``Runtime`` on the simulated backend with zero compute delays streams one
  request, one event per token; microseconds per token from the first token to the last, so it
  holds the engine's step job on its compute thread (sampling included), the engine, the router
  and the host stream.
- ``hop.token_compute_us``: the same work without the runtime: the simulated backend's prefill and
  logits and the runtime's sampler in a plain loop on one thread. ``token_us`` minus this is what
  the runtime adds per token.
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio

from bench.results import OVERHEAD_MODEL, Measurement
from runtime.backends.simulated import RealClock, SimulatedBackend
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.actor import ActorSystem
from runtime.kernel.core import Address, Context
from runtime.messages import Message, ModelSpec, Sampling, TokensEmitted
from runtime.text.coalesce import CoalescePolicy

SYSTEM = "runtime"
MODEL = OVERHEAD_MODEL
UVLOOP = {"use_uvloop": True}
KV_BUDGET_BYTES = 64 << 20  # given, so that the config need not ask MLX for the machine's memory


@dataclass(frozen=True)
class HopSizes:
    """Messages and tokens per repetition (``--quick`` shrinks them)."""

    messages: int = 20_000
    warmup_messages: int = 2_000
    tokens: int = 2_000
    repetitions: int = 5


HOP_QUICK = HopSizes(messages=5_000, warmup_messages=500, tokens=500, repetitions=1)


class Ball(Message, frozen=True, kw_only=True):
    """The message two bench actors pass back and forth."""


class Player:
    """An ``ActorCore`` that stamps each arrival and sends the ball back until ``stamps`` is full.

    Both players share ``stamps``: the ball alternates, so consecutive stamps are one hop apart.
    """

    def __init__(self, stamps: list[float], limit: int, done: Callable[[], None]) -> None:
        self._stamps = stamps
        self._limit = limit
        self._done = done

    def on_start(self, ctx: Context) -> None:
        pass

    def handle(self, message: Message, sender: Address, ctx: Context) -> None:
        self._stamps.append(time.perf_counter())
        if len(self._stamps) < self._limit:
            ctx.send(sender, Ball())
        else:
            self._done()

    def on_stop(self, ctx: Context) -> None:
        pass


def hops_us(stamps: Sequence[float]) -> list[float]:
    """Microseconds between consecutive arrivals: one per hop."""
    return [(b - a) * 1e6 for a, b in itertools.pairwise(stamps)]


def percentile(values: Sequence[float], p: int) -> float:
    """The ``p``-th percentile (1..99) of ``values``, interpolated between samples."""
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


async def rally(messages: int) -> list[float]:
    """The arrival stamps of one ball passed ``messages`` times between two fresh actors."""
    stamps: list[float] = []
    finished = anyio.Event()
    async with anyio.create_task_group() as tg:
        system = ActorSystem(tg)
        system.spawn("a", Player(stamps, messages, finished.set))
        system.spawn("b", Player(stamps, messages, finished.set))
        system.tell("a", Ball(), sender="b")
        await finished.wait()
        system.stop("a")
        system.stop("b")
    return stamps


async def _hops(sizes: HopSizes) -> list[float]:
    await rally(sizes.warmup_messages)
    hops: list[float] = []
    for _ in range(sizes.repetitions):
        hops.extend(hops_us(await rally(sizes.messages)))
    return hops


async def _token_us(sizes: HopSizes) -> list[float]:
    """Per repetition: microseconds per token over one stream of ``sizes.tokens`` tokens."""
    spec = ModelSpec(name=MODEL, backend="simulated")
    per_token = CoalescePolicy(enabled=False)
    samples = []
    async with Runtime(RuntimeConfig(kv_budget_bytes=KV_BUDGET_BYTES)) as rt:
        await rt.load_model(spec)
        for rep in range(sizes.repetitions + 1):  # the first is a warmup: MLX loads on it
            stamps: list[float] = []
            prompt = (rep % 200 + 1, 2, 3)  # distinct per repetition: no prefix reuse to skew it
            async with rt.generate(
                MODEL, prompt_tokens=prompt, max_tokens=sizes.tokens, coalesce=per_token
            ) as stream:
                async for event in stream:
                    if isinstance(event, TokensEmitted):
                        stamps.extend(time.perf_counter() for _ in event.token_ids)
            if rep:
                samples.append((stamps[-1] - stamps[0]) * 1e6 / (len(stamps) - 1))
    return samples


def _compute_us(sizes: HopSizes) -> list[float]:
    """Per repetition: microseconds per token of the step job's backend and sampler work alone."""
    from runtime.text.sampling import TokenSampler  # imports mlx-lm: only when measured

    backend = SimulatedBackend.load(ModelSpec(name=MODEL, backend="simulated"), RealClock())
    samples = []
    for rep in range(sizes.repetitions + 1):
        state = backend.new_state()
        tokens = [rep % 200 + 1, 2, 3]
        sampler = TokenSampler(Sampling(), backend.info.vocab_size, lambda t: backend.decode([t]))
        rng = random.Random(rep)
        backend.prefill(state, tokens)
        began = time.perf_counter()
        for _ in range(sizes.tokens):
            tokens.append(sampler.sample(backend.logits(state), tokens, rng).token)
            backend.prefill(state, tokens[-1:])
        if rep:
            samples.append((time.perf_counter() - began) * 1e6 / sizes.tokens)
    return samples


def _row(scenario: str, value: float, samples: Sequence[float] = (), note: str = "") -> Measurement:
    return Measurement(
        SYSTEM, MODEL, scenario, round(value, 2), "us", [round(s, 2) for s in samples], note
    )


def measure(sizes: HopSizes) -> list[Measurement]:
    hops = anyio.run(_hops, sizes, backend_options=UVLOOP)
    tokens = anyio.run(_token_us, sizes, backend_options=UVLOOP)
    compute = _compute_us(sizes)
    return [
        _row(
            "hop.message_us_p50",
            percentile(hops, 50),
            note=f"{len(hops)} hops ({sizes.repetitions} x {sizes.messages} messages), uvloop",
        ),
        _row("hop.message_us_p90", percentile(hops, 90)),
        _row(
            "hop.token_us",
            statistics.median(tokens),
            tokens,
            f"{sizes.tokens} tokens, one event each, zero compute delay, uvloop",
        ),
        _row(
            "hop.token_compute_us",
            statistics.median(compute),
            compute,
            "simulated backend prefill + logits + TokenSampler, one thread, no runtime",
        ),
    ]
