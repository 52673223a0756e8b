"""The architecture matrix's prompts, and one model in a Runtime beside raw mlx-lm's outputs.

tests/test_architectures.py runs its cases on an ``ArchModel``: the Runtime (driven through a
blocking portal) with one tiny build of ``runtime.testing.arch_models`` loaded, and
``References``: raw mlx-lm's greedy output of every prompt the cases send, computed before the
Runtime starts, so MLX never runs on two threads at once (some models keep arrays bound to the
thread that made them). ``ArchModel.expect`` checks one generate against both references: its
tokens against raw mlx-lm's, its reuse against ``ReuseOracle``'s prediction.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
import anyio.from_thread

from runtime.host.api import Runtime
from runtime.messages import (
    Cancelled,
    Failed,
    Finished,
    FinishReason,
    ModelLoaded,
    Started,
    TokensEmitted,
    Usage,
)
from runtime.testing.arch_oracle import Reference, ReuseOracle, raw_greedy
from runtime.testing.harness import engine_stats, wait_until

R_co = TypeVar("R_co", covariant=True)

MAX_TOKENS = 8
CHUNK = 32  # prefill chunk: a 300-token prompt takes ~10, so a cancel lands midway
SPACING = 64  # periodic checkpoints (the smallest spacing the engine uses)
REUSE_CASES = ("extend", "repeat", "backspace", "edit_middle", "diverge", "chat_turn_2")


def prompt_tokens(n: int, seed: int) -> list[int]:
    """``n`` ordinary token ids (no special tokens), drawn from ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


BASE_TOKENS = 220
CHAT_NEXT = prompt_tokens(24, seed=2)  # the user's next turn, after the model's reply
TAILS = (6, 13, 21, 30)  # what four concurrent prompts add to a shared prefix: one chunk or less
CONCURRENT = [prompt_tokens(n, seed=10 + n) for n in (180, 230, 270, 300)]  # four fresh prompts
CANCELLED = prompt_tokens(300, seed=20)  # the prompt whose prefill is cancelled midway


def case_prompt(case: str, base: list[int], first_output: Sequence[int]) -> list[int]:
    """The prompt a reuse case sends after ``base`` (which answered ``first_output``)."""
    match case:
        case "extend":
            return base + prompt_tokens(30, seed=3)
        case "repeat":
            return list(base)
        case "backspace":
            return base[:-6]
        case "edit_middle":
            edited = list(base)
            edited[110] = 5 if edited[110] != 5 else 6
            return edited
        case "diverge":
            return base[:-40] + prompt_tokens(40, seed=4)
        case "chat_turn_2":
            return base + list(first_output) + CHAT_NEXT
    raise ValueError(case)


# ---------------------------------------------------------------------- one model in a Runtime


@dataclass
class Run:
    """A generate that ran to ``max_tokens``: its tokens, its ``Started``, what the engine
    prefilled for it and the usage its ``Finished`` reported."""

    tokens: tuple[int, ...]
    started: Started
    prefilled: int
    usage: Usage


@dataclass(frozen=True)
class References:
    """Raw mlx-lm's output of every prompt the cases send, computed before the Runtime starts (so
    two threads never run MLX at once: some models keep arrays bound to the thread that made
    them), and ``base``: the prompt the walk starts from."""

    base: list[int]
    outputs: dict[tuple[int, ...], Reference]

    @classmethod
    def compute(cls, raw: Any) -> References:
        outputs: dict[tuple[int, ...], Reference] = {}

        def run(prompt: list[int]) -> Reference:
            return outputs.setdefault(tuple(prompt), raw_greedy(raw, prompt, MAX_TOKENS))

        # The first of a few seeds whose greedy output raw mlx-lm decides by a clear margin at
        # every step: the cases built on it then compare every token.
        candidates = [prompt_tokens(BASE_TOKENS, seed=seed) for seed in range(1, 9)]
        base = next((p for p in candidates if run(p).clear_steps == MAX_TOKENS), candidates[0])
        answer = run(base).tokens
        for prompt in (
            *(case_prompt(case, base, answer) for case in REUSE_CASES),
            *CONCURRENT,
            *(base + prompt_tokens(n, seed=30 + n) for n in TAILS),
            CANCELLED,
        ):
            run(prompt)
        return cls(base, outputs)

    def __call__(self, prompt: Sequence[int]) -> Reference:
        return self.outputs[tuple(prompt)]

    @property
    def clear(self) -> float:
        """The share of all reference steps decided by a clear margin (the steps compared)."""
        steps = [(r.clear_steps, len(r.tokens)) for r in self.outputs.values()]
        return sum(c for c, _ in steps) / sum(n for _, n in steps)


@dataclass
class ArchModel:
    """One architecture loaded in a Runtime driven through a blocking portal, and raw mlx-lm's
    outputs of the prompts its cases send."""

    arch: str
    portal: anyio.from_thread.BlockingPortal
    rt: Runtime
    loaded_as: ModelLoaded | str  # the reply, or why the load failed
    reference: References
    tokenizer: Any
    namespaces: int = 0
    walk: tuple[str, ReuseOracle, Run] | None = None  # the cases' namespace, after ``base``

    @property
    def base(self) -> list[int]:
        return self.reference.base

    @property
    def loaded(self) -> ModelLoaded:
        """The load's reply; a case on a model that failed to load fails with the reason."""
        if isinstance(self.loaded_as, str):
            raise AssertionError(f"the load failed: {self.loaded_as}")
        return self.loaded_as

    async def walked(self) -> tuple[str, ReuseOracle, Run]:
        """The namespace the cold case and the reuse cases share, in turn, and the cold run of
        ``base`` that starts it (made here when a case runs without the cold one)."""
        if self.walk is None:
            namespace, oracle = self.namespace(), self.oracle()
            cold = await self.expect(self.base, namespace, oracle)
            self.walk = (namespace, oracle, cold)
        return self.walk

    def oracle(self) -> ReuseOracle:
        checkpointing = self.loaded.reuse_path == "checkpoint"
        return ReuseOracle(checkpointing, SPACING, self.tokenizer.decode)

    def namespace(self) -> str:
        self.namespaces += 1
        return f"ns{self.namespaces}"

    def counter(self, name: str) -> int:
        return engine_stats(self.rt, self.loaded).counters.get(name, 0)

    async def complete(self, prompt: Sequence[int], namespace: str) -> Run:
        before = self.counter("prefilled_tokens")
        done = await self.rt.complete(
            self.arch, prompt_tokens=list(prompt), max_tokens=MAX_TOKENS, namespace=namespace
        )
        terminal = done.terminal
        assert isinstance(terminal, Finished), f"ended {type(terminal).__name__}: {terminal}"[:300]
        assert terminal.reason is FinishReason.LENGTH, terminal
        assert done.started is not None
        prefilled = self.counter("prefilled_tokens") - before
        return Run(done.token_ids, done.started, prefilled, terminal.usage)

    async def expect(self, prompt: Sequence[int], namespace: str, oracle: ReuseOracle) -> Run:
        """Generate ``prompt``: the output equals raw mlx-lm's, the reuse what ``oracle`` says."""
        reused, paths = oracle.reusable(prompt)
        run = await self.complete(prompt, namespace)
        observed = (run.started.cached_tokens, run.prefilled, str(run.started.path))
        assert observed[:2] == (reused, len(prompt) - reused), f"(cached, prefilled) {observed}"
        assert run.usage.cached_prompt_tokens == reused, f"usage {run.usage}"
        assert observed[2] in paths, f"path {observed[2]}, expected one of {paths}"
        expected = self.reference(prompt)
        assert expected.agree(run.tokens), f"output {run.tokens} != raw mlx-lm {expected}"
        oracle.generated(prompt, run.tokens, reused)
        return run


class Completes(Protocol[R_co]):
    """What ``run_concurrently`` drives: a model harness that runs one prompt to its end."""

    async def complete(self, prompt: list[int], namespace: str) -> R_co: ...


async def run_concurrently(
    model: Completes[R_co], prompts: list[list[int]], namespace: str
) -> dict[int, R_co]:
    """Every prompt at once, each to its end; the runs by index."""
    runs: dict[int, R_co] = {}

    async def one(index: int) -> None:
        runs[index] = await model.complete(prompts[index], namespace)

    async with anyio.create_task_group() as tg:
        for index in range(len(prompts)):
            tg.start_soon(one, index)
    return runs


async def cancel_mid_prefill(
    rt: Runtime, model: str, prompt: list[int], namespace: str, progressed: Callable[[], bool]
) -> object:
    """Generate ``prompt`` as request "doomed", cancel it once ``progressed()`` holds (polled
    with ``wait_until``) and return its terminal event; asserts that no token came first."""
    terminal: object = None

    async def cancel_midway() -> None:
        await wait_until(rt, progressed)
        await rt.cancel("doomed")

    async with (
        rt.generate(
            model,
            prompt_tokens=prompt,
            max_tokens=MAX_TOKENS,
            namespace=namespace,
            request_id="doomed",
        ) as stream,
        anyio.create_task_group() as tg,
    ):
        async for event in stream:
            assert not isinstance(event, TokensEmitted), "the prefill was not interrupted"
            if isinstance(event, Started):
                tg.start_soon(cancel_midway)
            elif isinstance(event, (Cancelled, Failed, Finished)):
                terminal = event
                tg.cancel_scope.cancel()  # a failed request is never cancelled
                break
    return terminal
