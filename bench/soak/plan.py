"""The plan of the simulated soak (bench/soak/driver.py): its models, and the requests a seed
draws, each with how its client cancels it. Pure data; nothing here runs."""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from runtime.backends.simulated import greedy_continuation
from runtime.messages import ModelSpec
from runtime.testing.harness import sim_spec

RELOADED_MODEL = "m"  # trimmable: prefix reuse by trimming; unloaded and loaded again mid-run
CHECKPOINT_MODEL = "h"  # not trimmable: reuse through whole entries and checkpoints
EOS_EVERY = 40  # about one greedy reply in three ends on EOS before its max_tokens
_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta", "rho")


class CancelHow(enum.Enum):
    """How the client cancels a request, after ``cancel_after`` of its events (0: at once)."""

    NONE = "none"
    BY_ID = "by_id"  # ``Runtime.cancel(request_id)``, then read the stream to its terminal
    LEAVE = "leave"  # leave the ``async with`` block early (the stream cancels and waits)


@dataclass(frozen=True)
class SoakConfig:
    """The size of a soak. ``requests`` counts prewarms; ``unload_after`` is the number of ended
    requests after which model ``m`` is unloaded and loaded again (while the others go on)."""

    seed: int = 0
    requests: int = 2000
    clients: int = 16
    unload_after: int = 1000
    budget_bytes: int = 2 << 20  # ~2,000 tokens of KV: reservations queue and entries are evicted
    chunk_tokens: int = 16  # short chunks, so a cancel often lands mid-prefill


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the plan; a prewarm is followed by a generate of its session."""

    index: int
    model: str
    prompt: str
    max_tokens: int
    prewarm: bool
    cancel: (
        CancelHow  # a prewarm's cancel leaves it (its task is cancelled) once its generate is in
    )
    cancel_after: int
    follow_waits: bool = False  # a prewarm's generate waits for its end (else runs beside it)


def expected_text(prompt: str, max_tokens: int) -> str:
    """The cold greedy reply: the simulated model's next token is a function of the prefix."""
    return bytes(greedy_continuation(list(prompt.encode()), max_tokens, EOS_EVERY)).decode()


def soak_models(config: SoakConfig) -> tuple[ModelSpec, ModelSpec]:
    """The two simulated models: free compute (the soak counts messages, not seconds)."""
    options = {"eos_every": EOS_EVERY, "context_length": 1024}
    return (
        sim_spec(RELOADED_MODEL, chunk=config.chunk_tokens, **options),
        sim_spec(
            CHECKPOINT_MODEL,
            chunk=config.chunk_tokens,
            trimmable=False,
            fixed_state_bytes=4096,
            **options,
        ),
    )


def plan_requests(config: SoakConfig) -> list[PlannedRequest]:
    """The seeded plan. Prompts share prefixes (a few documents, then drawn words), so requests
    reuse, trim and checkpoint each other's entries. A prewarm is followed by the generate it is
    for: its prompt, or its prompt extended (exact hits, adoptions); both count as requests."""
    rng = random.Random(config.seed)
    documents = [" ".join(rng.choices(_WORDS, k=rng.randint(4, 24))) for _ in range(8)]
    plan: list[PlannedRequest] = []

    def add(model: str, prompt: str, prewarm: bool) -> None:
        plan.append(
            PlannedRequest(
                index=len(plan),
                model=model,
                prompt=prompt,
                max_tokens=rng.randint(1, 24),
                prewarm=prewarm,
                cancel=rng.choices(list(CancelHow), weights=(6, 2, 2))[0],
                cancel_after=rng.randint(0, 3),
                follow_waits=prewarm and rng.random() < 0.5,
            )
        )

    while len(plan) < config.requests:
        model = rng.choice((RELOADED_MODEL, CHECKPOINT_MODEL))
        prompt = rng.choice(documents) + " " + " ".join(rng.choices(_WORDS, k=rng.randint(0, 4)))
        if rng.random() < 0.1 and len(plan) + 2 <= config.requests:
            add(model, prompt, prewarm=True)
            prompt += rng.choice(("", "", " " + rng.choice(_WORDS)))
        add(model, prompt, prewarm=False)
    return plan
