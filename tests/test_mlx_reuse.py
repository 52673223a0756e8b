"""Prefix reuse through the Runtime on the real MLX backend (tiny offline models, all 3 layouts).

Two properties, for a full-attention model (trimmable), a sliding-window one and a hybrid
recurrent one (checkpoints):

* reuse never changes the output: every greedy run equals a cold run of the same prompt (a
  second model load, its prefix cache reset before each reference run);
* reuse really happens: the engine's ``prefilled_tokens`` counter moves by exactly what the reuse
  semantics leave to compute, predicted by ``CacheModel`` below.
"""

from __future__ import annotations

import contextlib
import functools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import anyio
import anyio.from_thread
import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.engine.checkpoints import LINE_STARTS
from runtime.backends.mlx.backend import MlxBackend
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    Finished,
    FinishReason,
    ModelLoaded,
    ModelSpec,
    Started,
    TokensEmitted,
)
from runtime.testing.harness import common_prefix_length, engine_stats, wait_until
from runtime.testing.tiny_models import SLIDING_WINDOW, TinyModelKind, tiny_model_path
from tests.loop_checks import LoopBackend, on_uvloop

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    # One loop: what this module checks is MLX's output, the same under either loop, and each
    # test costs seconds; the simulated tests run the runtime on both loops.
    return on_uvloop()


KINDS: tuple[TinyModelKind, ...] = ("llama", "sliding", "hybrid")
CHUNK = 16
CHECKPOINT_EVERY = 32
MAX_TOKENS = 6
COLD = "cold"
WARM = "warm"


def spec(kind: TinyModelKind, name: str) -> ModelSpec:
    return ModelSpec(
        name=name,
        backend="mlx",
        path=str(tiny_model_path(kind)),
        prefill_chunk_tokens=CHUNK,
        options={"checkpoint_every_tokens": CHECKPOINT_EVERY},
    )


def config() -> RuntimeConfig:
    return RuntimeConfig(kv_budget_bytes=512 << 20)


@functools.cache
def tokenizer() -> MlxBackend:
    """Encode/decode only (every tiny model shares one tokenizer)."""
    return MlxBackend.load(spec("llama", "tokenizer"))


def enc(text: str) -> list[int]:
    return tokenizer().encode(text)


SYSTEM = "system: you are a terse assistant that answers in one line.\nuser: "
QUESTION = SYSTEM + "what does fibonacci(10) return, and why?\nassistant:"
CODE = (
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "class Counter:\n    def __init__(self, start: int = 0) -> None:\n"
)


def long_prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` ordinary token ids (no specials)."""
    rng = random.Random(seed)
    return [rng.randrange(5, 500) for _ in range(n)]


# ---------------------------------------------------------------------- harness


@dataclass
class Run:
    tokens: tuple[int, ...]
    prefilled: int
    started: Started | None
    terminal: object


@dataclass
class Harness:
    """A Runtime with the same tiny model loaded twice: a warm one reusing, a cold reference."""

    rt: Runtime
    warm: str = WARM
    cold_name: str = COLD
    loaded: dict[str, ModelLoaded] = field(default_factory=dict)

    @classmethod
    async def start(cls, rt: Runtime, kind: TinyModelKind, suffix: str = "") -> Harness:
        harness = cls(rt, WARM + suffix, COLD + suffix)
        for name in (harness.warm, harness.cold_name):
            harness.loaded[name] = await rt.load_model(spec(kind, name))
        return harness

    def prefilled_total(self, name: str | None = None) -> int:
        name = name or self.warm
        return engine_stats(self.rt, self.loaded[name]).counters.get("prefilled_tokens", 0)

    async def generate(self, prompt: Sequence[int], name: str | None = None) -> Run:
        name = name or self.warm
        before = self.prefilled_total(name)
        result = await self.rt.complete(name, prompt_tokens=list(prompt), max_tokens=MAX_TOKENS)
        assert isinstance(result.terminal, Finished), result.terminal
        return Run(
            result.token_ids, self.prefilled_total(name) - before, result.started, result.terminal
        )

    async def cold(self, prompt: Sequence[int]) -> tuple[int, ...]:
        await self.rt.reset(self.cold_name)
        run = await self.generate(prompt, self.cold_name)
        assert run.prefilled == len(prompt)
        assert len(run.tokens) == MAX_TOKENS
        return run.tokens

    async def prewarm(self, prompt: Sequence[int]) -> Run:
        before = self.prefilled_total()
        terminal = await self.rt.prewarm(self.warm, prompt_tokens=list(prompt))
        assert isinstance(terminal, Finished), terminal
        assert terminal.reason is FinishReason.PREWARMED
        return Run((), self.prefilled_total() - before, None, terminal)

    async def abort_mid_prefill(self, prompt: Sequence[int], *, by_id: bool = False) -> Run:
        """Start a generate and cancel it once 3 chunks are prefilled (while still prefilling)."""
        before = self.prefilled_total()
        started: Started | None = None
        terminal: object = None
        async with self.rt.generate(
            self.warm, prompt_tokens=list(prompt), max_tokens=MAX_TOKENS, request_id="doomed"
        ) as stream:
            async for event in stream:
                if isinstance(event, Started):
                    started = event
                    # Let a few chunks run (past the sliding window), then abort mid-prefill.
                    await wait_until(self.rt, lambda: self.prefilled_total() - before >= 3 * CHUNK)
                    if not by_id:
                        break
                    assert await self.rt.cancel("doomed")
                elif isinstance(event, Cancelled):
                    terminal = event
                    break
                else:
                    assert not isinstance(event, TokensEmitted), "the prefill was not interrupted"
        assert started is not None
        assert terminal is not None or not by_id
        return Run((), self.prefilled_total() - before, started, terminal)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> TinyModelKind:
    return request.param  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- a. reuse == cold


async def test_later_turns_equal_cold_runs(kind: TinyModelKind) -> None:
    code = enc(CODE)
    question = enc(QUESTION)
    prompts = [
        question,
        question,  # exact repeat
        question + enc(" be brief."),  # extension
        question[:20] + enc("how long is a piece of string?\nassistant:"),  # diverges at 20
        code,  # no shared prefix, longer than the sliding window
        code + enc("        self.count = start\n"),
        code[:50] + enc("    pass\n"),  # shares 50 tokens of an 80+ token entry
        code,
    ]
    assert len(code) >= 80 > 2 * SLIDING_WINDOW
    async with Runtime(config()) as rt:
        h = await Harness.start(rt, kind)
        for index, prompt in enumerate(prompts):
            warm = await h.generate(prompt)
            assert warm.tokens == await h.cold(prompt), f"prompt {index} ({len(prompt)} tokens)"
        # Turn two of a chat: the first reply is part of the second prompt.
        first = await h.generate(code)
        second = code + list(first.tokens) + enc("\nuser: and then?")
        assert (await h.generate(second)).tokens == await h.cold(second)


# ---------------------------------------------------------------------- b. prewarm


async def test_prewarm_then_generate_equals_cold(kind: TinyModelKind) -> None:
    async with Runtime(config()) as rt:
        h = await Harness.start(rt, kind)
        for prompt in (enc(QUESTION), enc(CODE)):
            await h.prewarm(prompt)
            assert (await h.generate(prompt)).tokens == await h.cold(prompt)
        extended = enc(CODE) + enc("        self.count = start\n")
        assert (await h.generate(extended)).tokens == await h.cold(extended)


# ---------------------------------------------------------------------- c. abort


@pytest.mark.parametrize("by_id", [False, True], ids=["break", "cancel"])
async def test_generate_after_an_aborted_prefill_equals_cold(
    kind: TinyModelKind, by_id: bool
) -> None:
    prompt = long_prompt(300, seed=1)
    async with Runtime(config()) as rt:
        h = await Harness.start(rt, kind)
        aborted = await h.abort_mid_prefill(prompt, by_id=by_id)
        assert 3 * CHUNK <= aborted.prefilled < len(prompt)
        for follow_up in (prompt, prompt + long_prompt(20, seed=2), long_prompt(120, seed=3)):
            assert (await h.generate(follow_up)).tokens == await h.cold(follow_up)
        # Aborted again, after an entry of the full prompt exists.
        await h.abort_mid_prefill(prompt[:100] + long_prompt(200, seed=4), by_id=by_id)
        assert (await h.generate(prompt)).tokens == await h.cold(prompt)


# ---------------------------------------------------------------------- d. property


@pytest.fixture(scope="module")
def portal_harnesses() -> Iterator[tuple[anyio.from_thread.BlockingPortal, dict[str, Harness]]]:
    with contextlib.ExitStack() as stack:
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        rt = stack.enter_context(portal.wrap_async_context_manager(Runtime(config())))

        async def start_all() -> dict[str, Harness]:
            return {kind: await Harness.start(rt, kind, f"-{kind}") for kind in KINDS}

        yield portal, portal.call(start_all)


VOCAB = st.integers(min_value=5, max_value=39)


@st.composite
def prompt_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    shared = draw(st.lists(VOCAB, max_size=48))
    first = shared + draw(st.lists(VOCAB, max_size=24))
    second = shared + draw(st.lists(VOCAB, max_size=24))
    if not first:
        first = [5]
    if not second:
        second = [6]
    return first, second


@pytest.mark.parametrize("model_kind", KINDS)
@given(pair=prompt_pairs())
def test_reuse_never_changes_greedy_output(
    portal_harnesses: tuple[anyio.from_thread.BlockingPortal, dict[str, Harness]],
    model_kind: TinyModelKind,
    pair: tuple[list[int], list[int]],
) -> None:
    portal, harnesses = portal_harnesses
    h = harnesses[model_kind]

    async def example() -> None:
        await h.rt.reset(h.warm)
        for prompt in (*pair, pair[0]):
            reused = await h.generate(prompt)
            assert reused.tokens == await h.cold(prompt), (prompt, pair)

    portal.call(example)


# ---------------------------------------------------------------------- e. reuse happens


@dataclass
class CacheModel:
    """The reuse semantics, as a prediction of how many prompt tokens a request prefills.

    Entries (all kinds): each generation's prompt + generated[:-1]; each prewarm's prompt[:-1]; an
    aborted prefill's state at its last completed chunk. Checkpoint layouts also snapshot, during
    every generate's prefill, the whole prompt, the state before the prompt's last token whose text
    starts with a space, the starts of its last ``LINE_STARTS`` lines, and every
    ``CHECKPOINT_EVERY`` tokens (absolute positions). (On a trimmable layout those snapshots are
    dominated by trimming the final entry, so adding them changes nothing.)

    A trimmable entry (llama; a sliding-window state that has not wrapped) serves its longest
    common prefix with the prompt; another serves only as a whole, strict prefix of the prompt.
    At least one prompt token is always prefilled.
    """

    kind: str
    entries: set[tuple[int, ...]] = field(default_factory=set)

    def reset(self) -> None:
        self.entries.clear()

    def trimmable(self, entry: Sequence[int]) -> bool:
        if self.kind == "llama":
            return True
        return self.kind == "sliding" and len(entry) < SLIDING_WINDOW

    def reusable(self, prompt: Sequence[int]) -> int:
        best = 0
        for entry in self.entries:
            if self.trimmable(entry):
                best = max(best, min(common_prefix_length(entry, prompt), len(prompt) - 1))
            elif len(entry) < len(prompt) and tuple(prompt[: len(entry)]) == entry:
                best = max(best, len(entry))
        return best

    def prefill(self, prompt: Sequence[int], end: int) -> int:
        """Record the snapshots of prefilling ``prompt[:end]``; return tokens prefilled."""
        start = self.reusable(prompt)
        boundaries = [i for i in range(1, len(prompt)) if _word_start(prompt[i])]
        # The starts of the last lines (the state after a token holding a newline).
        lines = [i + 1 for i in range(len(prompt) - 2, 0, -1) if "\n" in _text(prompt[i])]
        marks = {len(prompt), *boundaries[-1:], *lines[:LINE_STARTS]}
        marks |= set(range(CHECKPOINT_EVERY, end + 1, CHECKPOINT_EVERY))
        for mark in marks:
            if start < mark <= end:
                self.entries.add(tuple(prompt[:mark]))
        return end - start

    def generate(self, prompt: Sequence[int], generated: Sequence[int]) -> int:
        prefilled = self.prefill(prompt, len(prompt))
        self.entries.add(tuple(prompt) + tuple(generated[:-1]))
        return prefilled


@functools.cache
def _text(token: int) -> str:
    return str(tokenizer().decode([token]))


def _word_start(token: int) -> bool:
    return _text(token).startswith(" ")


@dataclass
class Scenario:
    """Drives the warm model and the prediction side by side; records (observed, predicted)."""

    h: Harness
    model: CacheModel
    rows: list[tuple[str, int, int, int]] = field(default_factory=list)

    async def reset(self) -> None:
        await self.h.rt.reset(self.h.warm)
        self.model.reset()

    async def generate(self, prompt: list[int], label: str | None = None) -> Run:
        run = await self.h.generate(prompt)
        predicted = self.model.generate(prompt, run.tokens)
        assert run.tokens == await self.h.cold(prompt)
        assert run.started is not None
        assert run.started.cached_tokens == len(prompt) - run.prefilled
        if label is not None:
            self.rows.append((label, run.prefilled, predicted, len(prompt)))
        return run

    async def prewarm(self, prompt: list[int], label: str | None = None) -> Run:
        run = await self.h.prewarm(prompt)
        predicted = self.model.prefill(prompt, len(prompt) - 1)
        self.model.entries.add(tuple(prompt[:-1]))  # the prewarm's own entry
        if label is not None:
            self.rows.append((label, run.prefilled, predicted, len(prompt) - 1))
        return run

    async def abort(self, prompt: list[int]) -> Run:
        run = await self.h.abort_mid_prefill(prompt)
        assert run.started is not None
        stopped_at = run.started.cached_tokens + run.prefilled
        assert stopped_at < len(prompt), "the prefill was not interrupted"
        self.model.prefill(prompt, stopped_at)
        self.model.entries.add(tuple(prompt[:stopped_at]))  # kept up to its last chunk
        return run


SCENARIOS = (
    "chat turn 2",
    "extended prompt",
    "exact repeat",
    "prewarm then generate",
    "resume after abort",
    "last word retyped",
    "edited in the middle",
)


@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_reuse_prefills_exactly_the_uncached_tokens(
    kind: TinyModelKind, scenario: str
) -> None:
    question = enc(QUESTION)
    async with Runtime(config()) as rt:
        s = Scenario(await Harness.start(rt, kind), CacheModel(kind))
        await s.reset()
        match scenario:
            case "chat turn 2":
                first = await s.generate(question)
                second = question + list(first.tokens) + enc("\nuser: and fibonacci(12)?")
                await s.generate(second, scenario)
            case "extended prompt":
                await s.generate(question)
                await s.generate(question + enc(" Be brief."), scenario)
            case "exact repeat":
                await s.generate(question)
                await s.generate(question, scenario)
            case "prewarm then generate":
                await s.prewarm(question, "prewarm (cold)")
                await s.generate(question, scenario)
            case "resume after abort":
                prompt = long_prompt(300, seed=5)
                await s.abort(prompt)
                await s.generate(prompt, scenario)
            case "last word retyped":
                await s.generate(enc(SYSTEM + "count the lines in the file named reports"))
                await s.generate(
                    enc(SYSTEM + "count the lines in the file named records"), scenario
                )
            case "edited in the middle":
                original = enc(CODE)
                edited = enc(CODE.replace("fibonacci(n - 2)", "fibonacci(n - 3)"))
                assert common_prefix_length(original, edited) > CHECKPOINT_EVERY + 8
                await s.generate(original)
                await s.generate(edited, scenario)
    assert s.rows
    table = "\n".join(
        f"{kind} {label}: prefilled {observed}, expected {predicted}, cold {cold}"
        for label, observed, predicted, cold in s.rows
    )
    assert [row[1] for row in s.rows] == [row[2] for row in s.rows], table
