"""Prefix reuse through the Runtime on llama.cpp's recurrent and hybrid models.

The tiny GGUF files of tests/llamacpp_tiny_gguf.py (``mamba``: recurrent only; ``lfm2``: attention
layers beside a recurrent state), loaded on the llama.cpp backend in an in-process Runtime. Their
state cannot be cut back, so docs/reuse.md predicts whole-entry or checkpoint reuse only:
``ReuseOracle`` (runtime/testing/arch_oracle.py) says for every request how many prompt tokens
are restored and by which path, at a 64-token checkpoint spacing (the option caps it there; it is
the default spacing of mamba and lfm2, tests/test_llamacpp_recurrent.py). Each request's output
equals a cold run of its prompt (the same model, a namespace of its own), and the first cold run
equals llama-cpp-python's own greedy loop over the file. ``lfm2-swa`` is lfm2 with a 32-token
attention window: llama.cpp's hybrid memory with a sliding-window cache.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest

from actors.engine.checkpoints import MAX_POINTS, CheckpointRule, plan_checkpoints
from runtime.backends.llamacpp.tokenizer import load_tokenizer, tokenizer_dir
from runtime.backends.model_source import converted_models_dir
from runtime.backends.options import LlamaCppOptions
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancelled,
    ChatMessage,
    ChatOptions,
    Finished,
    FinishReason,
    ModelLoaded,
    ModelSpec,
    Started,
)
from runtime.testing.arch_harness import (
    CANCELLED,
    CHAT_NEXT,
    CONCURRENT,
    MAX_TOKENS,
    REUSE_CASES,
    SPACING,
    TAILS,
    cancel_mid_prefill,
    case_prompt,
    prompt_tokens,
    run_concurrently,
)
from runtime.testing.arch_oracle import ReuseOracle
from runtime.testing.harness import engine_stats
from runtime.text.chat import PreparedPrompt, prepare_chat

ARCHS = ("mamba", "lfm2", "lfm2-swa")
CHUNK = 32  # prefill chunk: the cancelled prompt takes ~47, so a cancel lands midway
LONG = CANCELLED + prompt_tokens(1200, seed=21)  # 1,500 tokens
CONFIG = RuntimeConfig(kv_budget_bytes=1 << 30)  # nothing is evicted or refused here


@dataclass
class Run:
    tokens: tuple[int, ...]
    started: Started
    prefilled: int
    text: str


class Chat(tuple[ChatMessage, ...]):
    """Chat messages sent as such (the engine renders them with the model's template)."""


Prompt = Sequence[int] | Chat


@dataclass
class Tiny:
    """One tiny model in a Runtime driven through a blocking portal (module scope)."""

    path: Path
    portal: anyio.from_thread.BlockingPortal
    rt: Runtime
    loaded: ModelLoaded
    tokenizer: Any
    cold_outputs: dict[tuple[object, ...], tuple[int, ...]] = field(default_factory=dict)
    namespaces: int = 0

    @property
    def name(self) -> str:
        return self.loaded.model

    def counter(self, name: str) -> int:
        return engine_stats(self.rt, self.loaded).counters.get(name, 0)

    def gauge(self, name: str) -> float:
        return engine_stats(self.rt, self.loaded).gauges.get(name, 0)

    def namespace(self) -> str:
        self.namespaces += 1
        return f"ns{self.namespaces}"

    def oracle(self) -> ReuseOracle:
        # The backend's default take_tail_tokens: the fixture's load leaves it on.
        return ReuseOracle(True, SPACING, self.tokenizer.decode, LlamaCppOptions().take_tail_tokens)

    async def complete(self, prompt: Prompt, namespace: str) -> Run:
        before = self.counter("prefilled_tokens")
        sent: dict[str, Any] = (
            {"messages": list(prompt)} if isinstance(prompt, Chat) else {"prompt_tokens": prompt}
        )
        done = await self.rt.complete(self.name, **sent, max_tokens=MAX_TOKENS, namespace=namespace)
        assert isinstance(done.terminal, Finished), done.terminal
        assert done.terminal.reason is FinishReason.LENGTH, done.terminal
        assert done.started is not None
        prefilled = self.counter("prefilled_tokens") - before
        return Run(done.token_ids, done.started, prefilled, done.text)

    def prepared(self, chat: Chat) -> PreparedPrompt:
        """The engine's own preparation of ``chat``: its tokens and message ends."""
        return prepare_chat(
            self.tokenizer, chat, ChatOptions(), MAX_TOKENS, self.loaded.context_length
        )

    async def cold(self, prompt: Prompt) -> tuple[int, ...]:
        """The output of ``prompt`` computed from nothing, in a namespace of its own."""
        key = tuple(prompt)
        if key not in self.cold_outputs:
            n = len(self.prepared(prompt).tokens) if isinstance(prompt, Chat) else len(prompt)
            run = await self.complete(prompt, self.namespace())
            assert (str(run.started.path), run.prefilled) == ("miss", n)
            self.cold_outputs[key] = run.tokens
        return self.cold_outputs[key]

    async def expect(self, prompt: Sequence[int], namespace: str, oracle: ReuseOracle) -> Run:
        """Generate ``prompt``: the reuse ``oracle`` predicts, the output of a cold run."""
        reused, paths = oracle.reusable(prompt)
        run = await self.complete(prompt, namespace)
        observed = (run.started.cached_tokens, run.prefilled)
        assert observed == (reused, len(prompt) - reused), "(cached, prefilled)"
        assert str(run.started.path) in paths, f"path {run.started.path}, expected {paths}"
        oracle.take(prompt, reused, run.started.taken)
        oracle.generated(prompt, run.tokens, reused)
        assert run.tokens == await self.cold(prompt), "reused != cold"
        return run


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tiny_llama_gguf: Callable[[str], Path]) -> Iterator[Tiny]:
    path = tiny_llama_gguf(request.param)
    spec = ModelSpec(
        name=request.param,
        path=str(path),
        backend="llamacpp",
        prefill_chunk_tokens=CHUNK,
        options={"n_threads": 1, "prefill_chunk_ms": 0, "checkpoint_every_tokens": SPACING},
    )
    tokenizer, _ = load_tokenizer(tokenizer_dir(path, converted_models_dir()))
    with contextlib.ExitStack() as stack:
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        rt = stack.enter_context(portal.wrap_async_context_manager(Runtime(CONFIG)))
        loaded = portal.call(rt.load_model, spec)
        assert loaded.reuse_path == "checkpoint"
        yield Tiny(path, portal, rt, loaded, tokenizer)


def test_every_reuse_case_prefills_what_the_semantics_predict_and_equals_cold(
    tiny: Tiny,
) -> None:
    """One namespace: a cold prompt, then an exact repeat, an extension, a chat's second turn
    (the reply and the next message appended), the last tokens deleted, an edit in the middle,
    the end replaced (a branch). Whole entries and checkpoints only: nothing is cut back."""
    base = prompt_tokens(220, seed=1)

    async def scenario() -> None:
        namespace, oracle = tiny.namespace(), tiny.oracle()
        first = await tiny.expect(base, namespace, oracle)
        assert str(first.started.path) == "miss"
        turn_2 = base + list(first.tokens) + CHAT_NEXT
        assert case_prompt("chat_turn_2", base, first.tokens) == turn_2
        for case in REUSE_CASES:
            run = await tiny.expect(case_prompt(case, base, first.tokens), namespace, oracle)
            if case == "chat_turn_2":  # the whole first turn: prompt and reply (less the last)
                assert run.started.cached_tokens == len(base) + MAX_TOKENS - 1
            if case == "edit_middle":  # the edit at 110: the 64-token checkpoint below it
                assert run.started.cached_tokens == 64
        assert tiny.counter("fallback_trim_refused") == 0

    tiny.portal.call(scenario)


def test_a_chats_second_turn_restores_the_first_at_a_message_end(tiny: Tiny) -> None:
    """Chat messages through the model's template, the checkpoints at the messages' ends
    predicted too (docs/reuse.md, points 4-5): the second turn, which re-renders the first
    reply, restores the whole first turn and equals a cold run."""
    system = ChatMessage("system", "You are a terse assistant.")
    turn_1 = Chat((system, ChatMessage("user", "Where is the lighthouse at Carrow Point?")))
    oracle = tiny.oracle()

    def commit(prepared: PreparedPrompt, output: Sequence[int], reused: int) -> None:
        rule = CheckpointRule(SPACING, MAX_POINTS)
        points = plan_checkpoints(
            prepared.tokens,
            reused,
            len(prepared.tokens),
            tiny.tokenizer.decode,
            rule,
            message_ends=prepared.message_ends,
            instructions_end=prepared.instructions_tokens,
        )
        oracle.commit((*prepared.tokens, *output[:-1]), set(points))

    async def turn(chat: Chat, namespace: str) -> Run:
        prepared = tiny.prepared(chat)
        reused, paths = oracle.reusable(prepared.tokens)
        run = await tiny.complete(chat, namespace)
        assert (run.started.cached_tokens, run.prefilled) == (
            reused,
            len(prepared.tokens) - reused,
        )
        assert str(run.started.path) in paths
        commit(prepared, run.tokens, reused)
        assert run.tokens == await tiny.cold(chat), "reused != cold"
        return run

    async def scenario() -> None:
        namespace = tiny.namespace()
        first = await turn(turn_1, namespace)
        reply = ChatMessage("assistant", first.text)
        turn_2 = Chat((*turn_1, reply, ChatMessage("user", "And when was it built?")))
        second = await turn(turn_2, namespace)
        # The reply re-renders to the tokens drawn: the whole first entry is restored (its
        # prompt and reply, less the reply's last token, which was never fed).
        entry = (*tiny.prepared(turn_1).tokens, *first.tokens[:-1])
        assert tiny.prepared(turn_2).tokens[: len(entry)] == entry
        assert second.started.cached_tokens == len(entry)

    tiny.portal.call(scenario)


def test_a_generate_after_a_prewarm_restores_the_prewarmed_prompt(tiny: Tiny) -> None:
    """A prewarm prefills all but the prompt's last token and caches that state; a generate of
    the prompt and a question restores all of it and equals a cold run."""
    prompt = prompt_tokens(250, seed=5)
    asked = prompt + prompt_tokens(12, seed=6)

    async def scenario() -> None:
        namespace, oracle = tiny.namespace(), tiny.oracle()
        before = tiny.counter("prefilled_tokens")
        ended = await tiny.rt.prewarm(tiny.name, prompt_tokens=prompt, namespace=namespace)
        assert isinstance(ended, Finished) and ended.reason is FinishReason.PREWARMED, ended
        assert tiny.counter("prefilled_tokens") - before == len(prompt) - 1
        target = len(prompt) - 1
        points = {p for p in oracle.snapshots(prompt, 0) if p < target}
        oracle.commit(prompt[:target], points)
        run = await tiny.expect(asked, namespace, oracle)
        assert run.started.cached_tokens == len(prompt) - 1

    tiny.portal.call(scenario)


def test_concurrent_streams_decode_in_one_batch_and_each_equals_cold(tiny: Tiny) -> None:
    """Four fresh prompts at once, decoded in one ``llama_decode`` per step (the recurrent
    states joined into a batch by copy); each equals its prompt alone."""

    async def scenario() -> None:
        namespace, joins = tiny.namespace(), tiny.counter("batch_joins")
        runs = await run_concurrently(tiny, CONCURRENT, namespace)
        assert tiny.counter("batch_joins") - joins >= 2, "no decode batch was formed"
        for index, prompt in enumerate(CONCURRENT):
            assert runs[index].tokens == await tiny.cold(prompt), f"stream {index}"

    tiny.portal.call(scenario)


def test_prompts_extending_a_cached_one_restore_it_and_prefill_together(tiny: Tiny) -> None:
    """A prompt, then four extending it by 6-30 tokens at once: each restores the whole first
    entry (its state, not a cut), their rests go in shared batched passes, each equals cold."""
    base = prompt_tokens(220, seed=1)
    prompts = [base + prompt_tokens(n, seed=30 + n) for n in TAILS]

    async def scenario() -> None:
        namespace, oracle = tiny.namespace(), tiny.oracle()
        await tiny.expect(base, namespace, oracle)
        together, before = tiny.counter("prefills_together"), tiny.counter("prefilled_tokens")
        runs = await run_concurrently(tiny, prompts, namespace)
        assert tiny.counter("prefills_together") > together, "no batched prefill"
        reused = [oracle.reusable(prompt)[0] for prompt in prompts]
        assert [runs[i].started.cached_tokens for i in range(len(prompts))] == reused
        rests = sum(len(prompt) - n for prompt, n in zip(prompts, reused, strict=True))
        assert tiny.counter("prefilled_tokens") - before == rests
        for index, prompt in enumerate(prompts):
            assert runs[index].tokens == await tiny.cold(prompt), f"stream {index}"

    tiny.portal.call(scenario)


def test_the_first_cold_run_equals_llama_cpps_own_greedy(tiny: Tiny) -> None:
    from llama_cpp import Llama

    base = prompt_tokens(220, seed=1)
    oracle = Llama(model_path=str(tiny.path), n_ctx=512, n_threads=1, verbose=False)
    try:
        expected = []
        for token in oracle.generate(base, temp=0.0, top_k=1, repeat_penalty=1.0):
            expected.append(token)
            if len(expected) == MAX_TOKENS:
                break
    finally:
        oracle.close()
    assert list(tiny.portal.call(tiny.cold, base)) == expected


def test_resume_after_a_cancelled_prefill_reuses_where_it_stopped(tiny: Tiny) -> None:
    """Cancelled midway: the chunks it finished are an entry (the state where it stopped, and
    the checkpoints it took before); the same prompt again restores all of it."""
    prompt = LONG

    async def scenario() -> None:
        namespace, oracle = tiny.namespace(), tiny.oracle()
        before = tiny.counter("prefilled_tokens")
        progressed = lambda: tiny.counter("prefilled_tokens") - before >= CHUNK  # noqa: E731
        terminal = await cancel_mid_prefill(tiny.rt, tiny.name, prompt, namespace, progressed)
        assert isinstance(terminal, Cancelled), f"ended {terminal}"[:300]
        stopped_at = tiny.counter("prefilled_tokens") - before
        assert CHUNK <= stopped_at < len(prompt), "the cancel missed the prefill"
        oracle.aborted(prompt, 0, stopped_at)
        rerun = await tiny.expect(prompt, namespace, oracle)
        assert rerun.started.cached_tokens == stopped_at

    tiny.portal.call(scenario)


def test_entries_are_charged_llama_cpps_real_state_bytes(tiny: Tiny) -> None:
    """An entry's bytes are what llama.cpp writes for its state (``llama_state_seq_get_size``
    of the same tokens, in a context of its own made as the engine's is) plus, for each
    checkpoint, what it writes for the recurrent part: the KV budget holds the real thing."""
    from runtime.backends.llamacpp.backend import LlamaCppBackend
    from runtime.backends.llamacpp.binding import PARTIAL_ONLY

    prompt = prompt_tokens(300, seed=7)

    async def scenario() -> tuple[float, float, int, tuple[int, ...]]:
        namespace = tiny.namespace()
        entries, point_bytes = tiny.gauge("entries"), tiny.gauge("entry_point_bytes")
        total, points = tiny.gauge("entry_bytes"), tiny.gauge("entry_points")
        run = await tiny.complete(prompt, namespace)
        assert tiny.gauge("entries") == entries + 1
        return (
            tiny.gauge("entry_bytes") - total,
            tiny.gauge("entry_point_bytes") - point_bytes,
            int(tiny.gauge("entry_points") - points),
            run.tokens,
        )

    entry, snapshots, n_points, output = tiny.portal.call(scenario)
    kept = [*prompt, *output[:-1]]  # the last drawn token is never fed
    assert n_points == len(tiny.oracle().snapshots(prompt, 0)) > 0
    spec = ModelSpec(name="bytes", path=str(tiny.path), backend="llamacpp")
    backend = LlamaCppBackend.load(spec)
    try:
        state = backend.new_state()
        backend.prefill(state, kept, logits=False)
        seq = backend.pool.resident(state)
        whole = backend.context.seq_size(seq)
        partial = backend.context.seq_size(seq, PARTIAL_ONLY)
    finally:
        backend.close()
    assert snapshots == n_points * partial
    assert entry - snapshots == whole


def test_a_turn_2_takes_the_entry_in_place_and_equals_cold(tiny: Tiny) -> None:
    """The default take (docs/reuse.md, "Taking an entry instead of copying it"): a chat's second
    turn takes the first turn's whole entry (its recurrent state used in place), and its output
    equals a cold run's."""
    base = prompt_tokens(220, seed=1)

    async def scenario() -> None:
        namespace = tiny.namespace()
        first = await tiny.complete(base, namespace)
        assert not first.started.taken
        turn_2 = [*base, *first.tokens, *CHAT_NEXT]
        second = await tiny.complete(turn_2, namespace)
        assert (second.started.taken, second.started.cached_tokens) == (
            True,
            len(base) + MAX_TOKENS - 1,
        )
        assert tuple(second.tokens) == await tiny.cold(turn_2)

    tiny.portal.call(scenario)
