"""Every prefix-reuse path on real pretrained weights: output equal to a cold run, and exact counts.

Two models, float32 on CPU, greedy, the runtime's default chunking (256 tokens) and checkpoint
spacing (512 tokens):

* SmolLM2-135M-Instruct: llama, every layer full attention, reuse path ``trim`` (an entry is cut
  back to its common prefix with the prompt);
* Gemma 3 270M (base model): 15 sliding-window layers with a 512-token ring and 3 full-attention
  layers, reuse path ``checkpoint`` (a state whose ring has wrapped is restorable only whole or at
  the checkpoints its prefill snapshotted). Its prompts are ~800 tokens, so every ring wraps.

Each scenario asserts the greedy output equals a cold run of the same prompt (the same model in a
namespace of its own, which shares nothing) and that the request prefilled exactly the tokens the
reuse semantics of docs/reuse.md leave to compute (``ReuseModel``): ``Started.cached_tokens``,
``Started.path`` and the engine's ``prefilled_tokens`` counter. Equality alone would also pass if
nothing were reused.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.from_thread
import pytest
from mlx_lm.utils import load_tokenizer

from actors.engine.checkpoints import BRANCH_REACH, LINE_STARTS, WORD_SCAN_TOKENS
from runtime.backends.llamacpp.tokenizer import tokenizer_dir
from runtime.backends.model_source import converted_models_dir, prepare_model
from runtime.backends.model_store import fetch_model
from runtime.backends.options import DEFAULT_CHECKPOINT_EVERY, LlamaCppOptions
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    ChatMessage,
    ChatOptions,
    Finished,
    FinishReason,
    ModelLoaded,
    ModelSpec,
    ReusePath,
    Started,
    TokensEmitted,
)
from runtime.testing.harness import common_prefix_length, engine_stats, wait_until
from runtime.text.chat import prepare_chat
from tests.llamacpp_support import require_llama_cpp

pytestmark = pytest.mark.real_model

MODELS = ("smollm2-135m-instruct", "gemma3-270m")
BACKENDS = ("mlx", "llamacpp")  # the same GGUF files: converted for MLX, as they are for llama.cpp
MAX_TOKENS = 6
CONFIG = RuntimeConfig(kv_budget_bytes=4 << 30)  # nothing is evicted or refused here
# Gemma 3 on llama.cpp (docs/models.md, exact reuse; scripts/llamacpp_gemma_exactness.py).
LAYOUT_REASON = (
    "llama.cpp: reused != cold at a near-tie: a copy past the window shifts the sliding cells "
    "by P - 512 (exact only at multiples of 16), and 3-7-row passes off 16-cell boundaries differ"
)

# Natural text, so that the models' continuations are meaningful (~800 tokens on both models).
CORPUS = (
    "The lighthouse at Carrow Point was built in 1852, after three ships were lost on the reef "
    "in a single winter. It stands on a shelf of black rock at the end of a narrow causeway that "
    "disappears under the sea twice a day, so for more than a century the keepers lived with the "
    "tides as closely as fishermen do. The tower is forty metres tall and painted white, with a "
    "red band below the lantern room, and on a clear night its light can be seen from twenty-two "
    "miles away.",
    "The first keeper was a former ship's carpenter named Thomas Pryce. He kept a logbook in "
    "which he wrote down the weather, the ships that passed, the oil he burned and the repairs he "
    "made. His entries are short and practical: a broken pane replaced, a gull trapped in the "
    "gallery, a fog that lasted four days. Only once does he write about himself, on the night "
    "his daughter was born in the cottage at the foot of the tower while a storm tore slates from "
    "the roof.",
    "Keeping the light was hard and repetitive work. Every evening the keeper climbed the hundred "
    "and twelve steps with a can of oil, trimmed the wicks, polished the brass and cleaned the "
    "great glass lens until it shone. During the night he wound the clockwork that turned the "
    "lens every two hours, and in fog he rang the bell by hand until his arms ached. In the "
    "morning he drew the curtains around the lantern so that the sun would not crack the glass "
    "or start a fire.",
    "In 1911 the oil lamp was replaced by a paraffin vapour burner, which gave a much brighter "
    "flame, and in 1958 the station was connected to the mainland by an electric cable laid "
    "across the seabed. The clockwork was replaced by an electric motor, and the keepers, who "
    "had once numbered three, were reduced to two. Visitors who came across the causeway at low "
    "tide were often surprised to find that the keepers grew potatoes, kept chickens and baked "
    "their own bread.",
    "The last keeper, Margaret Hale, left the tower in 1987, when the light was automated. She "
    "had lived there for nineteen years with her husband, who maintained the engines, and she "
    "later said that what she missed most was not the view but the routine: the same tasks at "
    "the same hours, the sense that the ships depended on her. On her final night she wrote in "
    "the logbook that the light was burning well and the sea was calm.",
    "Today the lighthouse is run from a control room two hundred miles away. A small solar panel "
    "charges the batteries, and a technician visits twice a year to check the lamp and the fog "
    "signal. The cottages have become a museum, where visitors can read the old logbooks and "
    "climb the tower on summer afternoons. From the gallery they can look down at the reef that "
    "once sank so many ships, now marked by a green buoy that rings softly in the swell.",
    "Local people still tell stories about the keepers. One says that Thomas Pryce rowed out "
    "alone in a gale to rescue the crew of a coal barge, and brought back seven men in a boat "
    "built for four. Another says that a keeper's dog once found its way home across the "
    "causeway in thick fog, barking at the bell so that the men on the rock could follow it. "
    "Nobody can prove either story, but both are painted on the wall of the harbour inn.",
    "In the museum there is a glass case that holds the original lens, taken down when the new "
    "lamp was fitted. It is made of hundreds of prisms set in a brass frame, and it weighs more "
    "than two tonnes. Children are often more interested in the keepers' kitchen, with its iron "
    "stove and the narrow bunks where the men slept between watches, than in the lens itself, "
    "but almost everyone stops to read the last entry in the logbook before they leave.",
)


@dataclass(frozen=True)
class Texts:
    """A model's document (Gemma's is longer than its 512-token window) and an edit inside it."""

    doc: str
    edited: str


LONG_DOC = "\n\n".join(CORPUS)  # ~800 tokens
SHORT_DOC = "\n\n".join(CORPUS[:6])  # ~600 tokens: 3 prefill chunks, so an abort can land inside
TEXTS = {
    # SmolLM2 trims to the edit (~token 390); Gemma restores its checkpoint at 512 (edit ~640).
    "smollm2-135m-instruct": Texts(SHORT_DOC, SHORT_DOC.replace("grew potatoes", "grew onions")),
    "gemma3-270m": Texts(LONG_DOC, LONG_DOC.replace("seven men in a boat", "six men in a boat")),
}
QUESTION = "\n\nQ: Who was the first keeper of the lighthouse?\nA:"
FOLLOW_UP = "\n\nQ: In which year was the light automated?\nA:"
TYPED = "\n\nThe keepers' favourite season was winter"
RETYPED = "\n\nThe keepers' favourite season was summer"
SYSTEM = ChatMessage("system", "You are a helpful assistant. Answer in one short sentence.")
CHAT_TURN_1 = (
    SYSTEM,
    ChatMessage("user", CORPUS[0] + "\n\nWhen was the lighthouse built?"),
)

Prompt = str | tuple[ChatMessage, ...]


# ---------------------------------------------------------------------- the reuse semantics


@dataclass(frozen=True)
class Entry:
    """A cached state: its tokens, and (not trimmable) the lengths it can be restored at."""

    tokens: tuple[int, ...]
    trimmable: bool
    restorable: frozenset[int]


@dataclass
class ReuseModel:
    """What one namespace's prefix cache serves, predicted from docs/reuse.md.

    Entries: a generate's prompt + output (minus the last sampled token when it ran out of
    ``max_tokens``), a prewarm's prompt minus its last token, an aborted prefill's prompt up to the
    chunk it reached. A trimmable entry (every layer full attention, or a sliding ring that has not
    wrapped) serves its common prefix with a prompt; another serves only at its end or at the
    checkpoints its prefill took (``checkpoints``) strictly inside it, and only when its tokens up
    to there prefix the prompt. At most ``len(prompt) - 1`` tokens are reused. A generate's
    lookup *takes* the entry it reuses (it leaves the cache) where at most ``take_tail`` of its
    tokens lie past the reuse point (docs/reuse.md; -1: the backend never takes). ``reaches``: a
    taken entry may instead be cut back past its checkpoint to the common prefix (a trim), where
    its sliding-window cells still allow it (llama.cpp's keep cells past the window; a copy holds
    only the window): whether they do depends on how llama.cpp placed them, so either is right.
    """

    checkpointing: bool
    window: int | None
    word_start: Callable[[int], bool]
    line_end: Callable[[int], bool]
    take_tail: int = -1
    reaches: bool = False
    entries: list[Entry] = field(default_factory=list)

    def reached(self, prompt: Sequence[int], started: Started) -> int:
        """What ``started`` reused if it cut a taken entry back past its checkpoint, else 0."""
        if not (self.reaches and started.taken and started.path is ReusePath.TRIM):
            return 0
        limit = len(prompt) - 1
        return max(
            (
                min(common_prefix_length(e.tokens, prompt), limit)
                for e in self.entries
                if not e.trimmable and self.serves(e, prompt) > 0 and self._takes(e, prompt)
            ),
            default=0,
        )

    def _takes(self, entry: Entry, prompt: Sequence[int]) -> bool:
        return len(entry.tokens) - self.serves(entry, prompt) <= self.take_tail

    def take(self, prompt: Sequence[int], started: Started) -> None:
        """Check ``Started.taken`` of a generate of ``prompt`` (looked up against the entries as
        they were) and drop the entry it took: of those serving the reuse, one that loses at
        most ``take_tail`` tokens, a whole one first, else the latest (as the cache breaks
        ties)."""
        reused = started.cached_tokens
        reach = self.reached(prompt, started) == reused
        takeable = [
            e
            for e in self.entries
            if reused
            and self._takes(e, prompt)
            and (
                self.serves(e, prompt) == reused
                or (
                    reach and min(common_prefix_length(e.tokens, prompt), len(prompt) - 1) == reused
                )
            )
        ]
        assert started.taken == bool(takeable), f"taken {started.taken}, expected {takeable!r}"
        if takeable:
            whole = [e for e in takeable if len(e.tokens) == self.serves(e, prompt)]
            self.entries.remove((whole or takeable)[-1])

    def serves(self, entry: Entry, prompt: Sequence[int]) -> int:
        """Tokens ``entry`` alone would serve ``prompt`` (0: none)."""
        limit = len(prompt) - 1
        if entry.trimmable:
            return min(common_prefix_length(entry.tokens, prompt), limit)
        fits = (p for p in entry.restorable if p <= limit and entry.tokens[:p] == prompt[:p])
        return max(fits, default=0)

    def reusable(self, prompt: Sequence[int]) -> tuple[int, set[ReusePath]]:
        """Tokens a lookup reuses, and the paths that may serve them (ties go by recency)."""
        limit = len(prompt) - 1
        best, paths = 0, {ReusePath.MISS}
        for entry in self.entries:
            if entry.trimmable:
                n = min(common_prefix_length(entry.tokens, prompt), limit)
                path = ReusePath.EXACT if n == len(entry.tokens) else ReusePath.TRIM
            else:
                fits = (
                    p for p in entry.restorable if p <= limit and entry.tokens[:p] == prompt[:p]
                )
                n, path = max(fits, default=0), ReusePath.CHECKPOINT
            if n > best:
                best, paths = n, {path}
            elif n == best > 0:
                paths.add(path)
        return best, paths

    def checkpoints(self, prompt: Sequence[int], start: int, target: int) -> set[int]:
        """Where a prefill from ``start`` to ``target`` snapshots (``plan_checkpoints``)."""
        if not self.checkpointing:
            return set()
        last = len(prompt) - 1
        points = set(range(DEFAULT_CHECKPOINT_EVERY, target, DEFAULT_CHECKPOINT_EVERY))
        scan = range(last, max(start, last - WORD_SCAN_TOKENS), -1)
        points.update(itertools.islice((i for i in scan if self.word_start(prompt[i])), 1))
        # The starts of the last lines near the end, and a point BRANCH_REACH before the end.
        near = range(last, max(start, len(prompt) - BRANCH_REACH), -1)
        starts = (i for i in near if self.line_end(prompt[i - 1]))
        points.update(itertools.islice(starts, LINE_STARTS))
        points.add(len(prompt) - BRANCH_REACH)
        inside = {p for p in points if start < p < target}
        # The end of the prompt, where a generate's prefill (its target) ends.
        return inside | ({target} if target == len(prompt) > start else set())

    def commit(self, tokens: Sequence[int], snapshots: set[int]) -> None:
        trimmable = not self.checkpointing or len(tokens) < (self.window or 0)
        restorable = frozenset() if trimmable else frozenset({*snapshots, len(tokens)})
        self.entries.append(Entry(tuple(tokens), trimmable, restorable))


# ---------------------------------------------------------------------- harness


@dataclass(frozen=True)
class AnyStopToken:
    """The stop token a pipelined decode fed before reading it: equal to any of the model's."""

    ids: frozenset[int]

    def __eq__(self, other: object) -> bool:
        return other in self.ids or other is self

    def __hash__(self) -> int:
        return hash(self.ids)


@dataclass
class Run:
    tokens: tuple[int, ...]
    text: str
    prefilled: int
    started: Started
    terminal: Finished


@dataclass
class RealModel:
    """One real model loaded in a Runtime driven through a blocking portal (module scope)."""

    portal: anyio.from_thread.BlockingPortal
    rt: Runtime
    loaded: ModelLoaded
    tokenizer: Any  # mlx-lm's TokenizerWrapper: the engine's own tokenizer and chat template
    texts: Texts
    window: int | None  # tokens a sliding-window layer keeps (config.json), None: no such layer
    pipelined: bool  # the backend builds a decode step on a token before reading it (MLX)
    take_tail: int = -1  # ModelInfo.take_tail_tokens of its backend (-1: it never takes)
    reaches: bool = False  # a taken entry may be cut back past its checkpoint (llama.cpp)
    cold_outputs: dict[tuple[int, ...], tuple[int, ...]] = field(default_factory=dict)
    rows: list[str] = field(default_factory=list)
    _namespaces: Iterator[int] = field(default_factory=itertools.count)

    @property
    def name(self) -> str:
        return self.loaded.model

    def tokens(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt tokens the engine will prefill (its tokenizer, its chat preparation)."""
        if isinstance(prompt, str):
            return tuple(self.tokenizer.encode(prompt))
        context = self.loaded.context_length
        return prepare_chat(self.tokenizer, prompt, ChatOptions(), MAX_TOKENS, context).tokens

    def word_start(self, token: int) -> bool:
        return str(self.tokenizer.decode([token]))[:1].isspace()

    def line_end(self, token: int) -> bool:
        return "\n" in str(self.tokenizer.decode([token]))

    def namespace(self, purpose: str) -> str:
        return f"{purpose}-{next(self._namespaces)}"

    def prefilled_total(self) -> int:
        return self.engine_counter("prefilled_tokens")

    def engine_counter(self, name: str) -> int:
        return engine_stats(self.rt, self.loaded).counters.get(name, 0)

    def request(self, prompt: Prompt) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"prompt": prompt}
        return {"messages": list(prompt)}

    async def complete(self, prompt: Prompt, namespace: str) -> Run:
        before = self.prefilled_total()
        done = await self.rt.complete(
            self.name, **self.request(prompt), max_tokens=MAX_TOKENS, namespace=namespace
        )
        assert isinstance(done.terminal, Finished), done.terminal
        assert done.started is not None
        prefilled = self.prefilled_total() - before
        return Run(done.token_ids, done.text, prefilled, done.started, done.terminal)

    async def cold(self, prompt: Prompt) -> tuple[int, ...]:
        """Greedy output of ``prompt`` computed from nothing (memoised per prompt tokens)."""
        tokens = self.tokens(prompt)
        if tokens not in self.cold_outputs:
            namespace = self.namespace("cold")
            run = await self.complete(prompt, namespace)
            assert (run.started.path, run.prefilled) == (ReusePath.MISS, len(tokens))
            self.cold_outputs[tokens] = run.tokens
            await self.rt.reset(self.name, namespace=namespace)
        return self.cold_outputs[tokens]


@pytest.fixture(
    scope="module",
    params=[(m, b) for b in BACKENDS for m in MODELS],
    ids=[f"{m}-{b}" for b in BACKENDS for m in MODELS],
)
def real(request: pytest.FixtureRequest, real_gguf: Callable[[str], object]) -> Iterator[RealModel]:
    name, backend = request.param
    real_gguf(name)  # skips (or fails under CI) like every real-model test
    path = prepare_model(ModelSpec(name=name, path=name)).path  # its config: the window
    window = json.loads((path / "config.json").read_text()).get("sliding_window")
    spec = ModelSpec(name=name, path=name)
    tokenizer_path = path
    # The backend's default take (LlamaCppOptions.take_tail_tokens, as a user's load runs): the
    # walks, one request at a time, take every entry ``ReuseModel.take`` says they may, and the
    # concurrent-streams test's four extenders copy theirs (docs/reuse.md, "Taking an entry").
    take_tail = -1
    if backend == "llamacpp":
        take_tail = LlamaCppOptions().take_tail_tokens
        require_llama_cpp()
        # exact_reuse: the kernels and passes that make a decoded token equal to the same token
        # prefilled (passes.py), where the weights allow it: SmolLM2's, not Gemma 3's (the
        # xfails below).
        options = {"n_threads": 1, "exact_reuse": True}
        spec = ModelSpec(name=name, path=name, backend=backend, options=options)
        tokenizer_path = tokenizer_dir(fetch_model(name), converted_models_dir())
    with contextlib.ExitStack() as stack:
        portal = stack.enter_context(anyio.from_thread.start_blocking_portal("asyncio"))
        rt = stack.enter_context(portal.wrap_async_context_manager(Runtime(CONFIG)))
        loaded = portal.call(rt.load_model, spec)
        assert loaded.reuse_path == ("trim" if name.startswith("smollm2") else "checkpoint")
        tokenizer = load_tokenizer(tokenizer_path)
        model = RealModel(
            portal,
            rt,
            loaded,
            tokenizer,
            TEXTS[name],
            window,
            pipelined=backend == "mlx",
            take_tail=take_tail,
            reaches=backend == "llamacpp",
        )
        yield model
        print("\n".join(model.rows))


@dataclass
class Walk:
    """Requests in one namespace of a real model, each checked against ``ReuseModel``."""

    real: RealModel
    namespace: str
    model: ReuseModel

    @classmethod
    def start(cls, real: RealModel, purpose: str) -> Walk:
        checkpointing = real.loaded.reuse_path == "checkpoint"
        model = ReuseModel(
            checkpointing,
            real.window,
            real.word_start,
            real.line_end,
            real.take_tail,
            reaches=real.reaches,
        )
        return cls(real, real.namespace(purpose), model)

    async def generate(self, prompt: Prompt, label: str) -> Run:
        tokens = self.real.tokens(prompt)
        reused, paths = self.model.reusable(tokens)
        run = await self.real.complete(prompt, self.namespace)
        if reach := self.model.reached(tokens, run.started):
            reused, paths = reach, {ReusePath.TRIM}
        self._check(label, tokens, run.started, run.prefilled, reused, paths)
        self.model.take(tokens, run.started)
        output: tuple[object, ...] = (*tokens, *run.tokens)
        if run.terminal.reason is FinishReason.LENGTH:
            output = output[:-1]  # the last allowed token is never fed
        elif run.terminal.stop is None and not self.model.checkpointing and self.real.pipelined:
            # On a model whose layers all trim, MLX builds the next step on the stop token before
            # reading it, so the cache (and the entry's key) holds it, unshown.
            output = (*output, AnyStopToken(frozenset(self.real.tokenizer.eos_token_ids)))
        self.model.commit(output, self.model.checkpoints(tokens, reused, len(tokens)))
        if reused == 0:  # a cold run itself: the reference for this prompt
            self.real.cold_outputs.setdefault(tokens, run.tokens)
        assert run.tokens == await self.real.cold(prompt), f"{label}: reused != cold"
        return run

    async def prewarm(self, prompt: str, label: str) -> int:
        tokens = self.real.tokens(prompt)
        reused, _ = self.model.reusable(tokens)
        before = self.real.prefilled_total()
        terminal = await self.real.rt.prewarm(self.real.name, prompt, namespace=self.namespace)
        prefilled = self.real.prefilled_total() - before
        assert isinstance(terminal, Finished), terminal
        assert terminal.reason is FinishReason.PREWARMED
        assert prefilled == len(tokens) - 1 - reused, label
        self.row(label, prefilled, len(tokens) - 1 - reused, len(tokens))
        target = len(tokens) - 1
        self.model.commit(tokens[:target], self.model.checkpoints(tokens, reused, target))
        return prefilled

    async def abort_after(self, prompt: str, prefilled_at_least: int, label: str) -> int:
        """Start ``prompt``, cancel it once that many tokens are prefilled; where it stopped."""
        tokens = self.real.tokens(prompt)
        reused, paths = self.model.reusable(tokens)
        before = self.real.prefilled_total()
        async with self.real.rt.generate(
            self.real.name, prompt, max_tokens=MAX_TOKENS, namespace=self.namespace
        ) as stream:
            async for event in stream:
                assert not isinstance(event, TokensEmitted), "the prefill was not interrupted"
                if isinstance(event, Started):
                    if reach := self.model.reached(tokens, event):
                        reused, paths = reach, {ReusePath.TRIM}
                    assert event.cached_tokens == reused, label
                    assert event.path in paths, label
                    self.model.take(tokens, event)
                    await wait_until(
                        self.real.rt,
                        lambda: self.real.prefilled_total() - before >= prefilled_at_least,
                        timeout=60,
                    )
                    break  # leaving the block cancels it and waits for Cancelled
        stopped_at = reused + self.real.prefilled_total() - before
        assert prefilled_at_least <= stopped_at < len(tokens), "the abort missed the prefill"
        done = stopped_at - reused
        self.row(f"{label} (where it stopped)", done, done, len(tokens))
        # Snapshots taken strictly before the stop become the aborted entry's checkpoints.
        snapshots = {
            p for p in self.model.checkpoints(tokens, reused, len(tokens)) if p < stopped_at
        }
        self.model.commit(tokens[:stopped_at], snapshots)
        return stopped_at

    def _check(
        self,
        label: str,
        tokens: Sequence[int],
        started: Started,
        prefilled: int,
        reused: int,
        paths: set[ReusePath],
    ) -> None:
        self.row(label, prefilled, len(tokens) - reused, len(tokens))
        assert started.prompt_tokens == len(tokens), f"{label}: tokenized differently"
        observed = (started.cached_tokens, prefilled)
        assert observed == (reused, len(tokens) - reused), f"{label}: (cached, prefilled)"
        assert started.path in paths, f"{label}: path {started.path}, expected one of {paths}"

    def row(self, label: str, prefilled: int, expected: int, prompt: int) -> None:
        self.real.rows.append(
            f"{self.real.name} {label}: prefilled {prefilled} (expected {expected}) "
            f"of {prompt} prompt tokens"
        )


# ---------------------------------------------------------------------- scenarios


def test_reused_prompts_equal_cold_runs(real: RealModel, request: pytest.FixtureRequest) -> None:
    """Exact repeat, extended prompt, turn 2, last word retyped, edit in the middle: one walk."""
    if request.node.callspec.id.endswith("gemma3-270m-llamacpp"):
        # Known and open (issue 22): every prefilled count is right, but a state restored and
        # extended by a short pass sometimes draws another 4th token than one cold pass (last
        # word typed). Not the chunk boundaries alone (docs/models.md, measured): a copy past
        # the 512-token window restores the sliding cells shifted by P - 512 cells, and with the
        # same passes its sums differ unless the shift is a multiple of 16 (P=700: 1.09 apart;
        # 528, 544, 768: 0); a 3-7-row pass off a 16-cell boundary differs too (0.6-0.95).
        # Runs, and XPASSes where the near-tie does not flip.
        request.applymarker(pytest.mark.xfail(reason=LAYOUT_REASON))
    doc = real.texts.doc

    async def scenario() -> None:
        walk = Walk.start(real, "walk")
        first = await walk.generate(doc, "first prompt (cold)")
        assert first.started.path is ReusePath.MISS
        await walk.generate(doc, "exact repeat")
        turn_1 = await walk.generate(doc + QUESTION, "extended prompt")
        if real.loaded.reuse_path == "trim":  # SmolLM2 is a chat model: a real conversation
            reply = await walk.generate(CHAT_TURN_1, "chat turn 1 (cold)")
            turn_2 = (
                *CHAT_TURN_1,
                ChatMessage("assistant", reply.text),
                ChatMessage("user", "How tall is the tower?"),
            )
            await walk.generate(turn_2, "chat turn 2")
        else:  # a base model: the transcript grows by the answer and the next question
            await walk.generate(doc + QUESTION + turn_1.text + FOLLOW_UP, "transcript turn 2")
        await walk.generate(doc + TYPED, "last word typed")
        await walk.generate(doc + RETYPED, "last word retyped")
        await walk.generate(real.texts.edited, "edited in the middle")

    real.portal.call(scenario)


def test_resume_after_an_aborted_prefill_equals_cold(
    real: RealModel, request: pytest.FixtureRequest
) -> None:
    """Cancelled once its first chunk is in: the chunks it finished are reused, the rest prefilled.

    The chunk under way when the cancel lands completes and is kept too (on Gemma the kept state
    then holds exactly its 512-token window, and the resumed prefill wraps the ring).
    """
    if request.node.callspec.id.endswith("gemma3-270m-llamacpp"):
        # Known and open (issue 22), as in the walk above: where the cancel lands decides where
        # the resumed state's sliding cells sit after its copy and which short passes it takes;
        # failed once in CI at a near-tie, passes most runs.
        request.applymarker(pytest.mark.xfail(reason=LAYOUT_REASON))

    async def scenario() -> None:
        walk = Walk.start(real, "abort")
        stopped_at = await walk.abort_after(real.texts.doc, 1, "aborted prefill")
        resumed = await walk.generate(real.texts.doc, "resume after abort")
        assert resumed.started.cached_tokens == stopped_at > 0

    real.portal.call(scenario)


def test_generate_after_prewarm_equals_cold(real: RealModel) -> None:
    doc = real.texts.doc

    async def scenario() -> None:
        walk = Walk.start(real, "prewarm")
        await walk.prewarm(doc, "prewarm (cold)")
        generated = await walk.generate(doc + QUESTION, "generate after prewarm")
        assert generated.started.cached_tokens == len(real.tokens(doc)) - 1

    real.portal.call(scenario)


def test_four_concurrent_streams_equal_each_alone(
    real: RealModel, request: pytest.FixtureRequest
) -> None:
    """Four requests restored from one prewarmed prefix decode in one batch; each equals cold."""
    if request.node.callspec.id.endswith("gemma3-270m-llamacpp"):
        # Known and open (issue 22): a batched row may draw another 4th token than the same
        # prompt alone: a batch join copies the state, so its sliding cells likely sit shifted
        # as a restored copy's do (LAYOUT_REASON; not measured on a batch); passes most runs.
        request.applymarker(pytest.mark.xfail(reason="llama.cpp: a batched row != alone"))
    doc = real.texts.doc
    # The walk's prompts: their cold outputs are already known when it ran first.
    prompts = [doc, doc + QUESTION, doc + TYPED, doc + RETYPED]

    async def scenario() -> None:
        walk = Walk.start(real, "batch")
        await walk.prewarm(doc, "prewarm (cold)")
        expected = [walk.model.reusable(real.tokens(p))[0] for p in prompts]
        joins, before = real.engine_counter("batch_joins"), real.prefilled_total()
        runs: dict[int, Run] = {}

        async def one(index: int) -> None:
            runs[index] = await real.complete(prompts[index], walk.namespace)

        async with anyio.create_task_group() as tg:
            for index in range(len(prompts)):
                tg.start_soon(one, index)
        assert real.engine_counter("batch_joins") - joins >= 2, "no decode batch was formed"
        lengths = [len(real.tokens(p)) for p in prompts]
        prefilled = sum(n - reused for n, reused in zip(lengths, expected, strict=True))
        walk.row("4 concurrent streams", real.prefilled_total() - before, prefilled, sum(lengths))
        assert real.prefilled_total() - before == prefilled
        for index, prompt in enumerate(prompts):
            assert runs[index].started.cached_tokens == expected[index], f"stream {index}"
            assert runs[index].tokens == await real.cold(prompt), f"stream {index}: != alone"

    real.portal.call(scenario)


def test_a_burst_of_short_prompts_is_prefilled_together_and_each_equals_cold(
    real: RealModel,
) -> None:
    """Fresh prompts of different lengths sent at once share one batched prefill (on Gemma with
    the checkpoints each plans, inside its window); each output equals its prompt's cold run."""
    prompts = list(CORPUS[:4])  # 80-100 tokens each

    async def scenario() -> None:
        namespace = real.namespace("burst")
        together = real.engine_counter("prefills_together")
        runs: dict[int, Run] = {}

        async def one(index: int) -> None:
            runs[index] = await real.complete(prompts[index], namespace)

        async with anyio.create_task_group() as tg:
            for index in range(len(prompts)):
                tg.start_soon(one, index)
        assert real.engine_counter("prefills_together") > together, "no batched prefill"
        for index, prompt in enumerate(prompts):
            assert runs[index].tokens == await real.cold(prompt), f"stream {index}: != alone"

    real.portal.call(scenario)


def notes(lines: int) -> str:
    """Numbered notes, one sentence of the corpus a line (28 lines ~920 tokens, 56 ~1,850)."""
    sentences = [s.rstrip(".") for p in CORPUS for s in p.split(". ")]
    numbered = (f"Note {i + 1}: {sentences[i % len(sentences)]}." for i in range(lines))
    return "Notes on the lighthouse at Carrow Point.\n" + "\n".join(numbered)


# Three prefills of up to ~1,900 tokens: past the 120 s default on a loaded 2-core machine.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lines", [28, 56])
def test_a_long_prompt_resent_with_its_last_line_changed_reprocesses_only_that_line(
    real: RealModel, lines: int
) -> None:
    """The notes stay, the question on the last line changes (what llama-server re-processes 20
    tokens of): SmolLM2 trims to the common prefix; Gemma on MLX restores the state at the start
    of the last line, snapshotted when the first prompt was prefilled; Gemma on llama.cpp takes
    the entry and cuts it back to the common prefix, as llama-server does, since its sliding
    window's cells are still there. Exact counts, output equal cold."""
    if lines > 28 and real.loaded.reuse_path == "trim":
        # 56 lines are for Gemma: its snapshots past three windows. A trim cuts back the same at
        # any length, and the 56-line runs took a minute of the suite on SmolLM2.
        pytest.skip("a trimmed cache cuts back alike at any length: 28 lines cover SmolLM2")
    text = notes(lines)
    asked = f"{text}\nQuestion: Who was the first keeper of the lighthouse?"
    changed = f"{text}\nQuestion: In which year was the light automated?"

    async def scenario() -> None:
        walk = Walk.start(real, "branch")
        await walk.generate(asked, "notes and a question (cold)")
        resent = await walk.generate(changed, "the same notes, another question")
        first, second = real.tokens(asked), real.tokens(changed)
        shared = common_prefix_length(first, second)
        if walk.model.checkpointing and not real.reaches:  # the question's line start
            shared = max(i for i in range(shared + 1) if real.line_end(first[i - 1]))
        elif walk.model.checkpointing:
            assert (resent.started.path, resent.started.taken) == (ReusePath.TRIM, True)
        assert resent.prefilled == len(second) - shared < 24
        assert len(second) > 900 * lines // 28

    real.portal.call(scenario)


# ---------------------------------------------------------------------- where answers end


def test_the_answer_to_a_question_ends_where_the_model_ends_it(real: RealModel) -> None:
    """SmolLM2 in chat form stops on ``<|im_end|>``; base Gemma answers a few-shot prompt."""

    async def chat() -> None:
        question = [ChatMessage("user", "What is the capital of France?")]
        done = await real.rt.complete(real.name, messages=question, max_tokens=48)
        assert isinstance(done.terminal, Finished), done.terminal
        # Ended by the end-of-turn token (not emitted), well before max_tokens.
        assert done.terminal.reason is FinishReason.STOP, done.text
        assert done.terminal.usage.completion_tokens < 48
        assert "Paris" in done.text
        assert "<|im_end|>" not in done.text

    async def few_shot() -> None:
        prompt = (
            "Q: What is the capital of Italy?\nA: Rome\n\n"
            "Q: What is the capital of Japan?\nA: Tokyo\n\n"
            "Q: What is the capital of France?\nA:"
        )
        done = await real.rt.complete(real.name, prompt, max_tokens=4)
        assert isinstance(done.terminal, Finished), done.terminal
        assert "Paris" in done.text, done.text

    if real.loaded.reuse_path == "trim" and not real.pipelined:
        # Checked on llama.cpp: its own greedy (llama_cpp.Llama) answers this Q4_1 prompt
        # "L'Étoile, la Cité, ..." too; test_llamacpp_backend.py holds the runtime to that.
        pytest.skip("SmolLM2 Q4_1 on llama.cpp's kernels does not answer 'Paris' here")
    real.portal.call(chat if real.loaded.reuse_path == "trim" else few_shot)
