"""What the architecture matrix (tests/test_architectures.py) compares the runtime against.

Two references, each independent of the engine's own bookkeeping. ``raw_greedy``: greedy decoding
with plain mlx-lm, with the top-2 logit margin of every step, so a comparison stops before a step
whose winner a float rounding could change (``agree``). ``ReuseOracle``: how many prompt tokens a
request restores from one namespace's prefix cache, from the reuse rules of docs/reuse.md (a
trimmable entry serves its common prefix with the prompt; another only its end and its checkpoints,
placed by ``actors.engine.checkpoints.plan_checkpoints``).

See docs/models.md for the matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from actors.engine.checkpoints import MAX_POINTS, CheckpointRule, plan_checkpoints
from runtime.testing.harness import common_prefix_length

# A step whose top-2 logits lie closer than this may flip between two exact computations that
# differ only in float rounding (chunked vs whole prefill, batched vs alone): never compared.
MARGIN: float = 5e-3


@dataclass(frozen=True)
class Reference:
    """Raw mlx-lm's greedy tokens for one prompt, and each step's top-2 logit margin."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...]

    @property
    def clear_steps(self) -> int:
        """How many leading tokens are decided by a margin of at least ``MARGIN``."""
        for step, margin in enumerate(self.margins):
            if margin < MARGIN:
                return step
        return len(self.margins)

    def agree(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` has this reference's length and equals it over the clear steps."""
        n = self.clear_steps
        return len(tokens) == len(self.tokens) and tuple(tokens[:n]) == self.tokens[:n]


def raw_greedy(model: Any, prompt: Sequence[int], max_tokens: int) -> Reference:
    """Greedy decoding of ``prompt`` with mlx-lm alone (no runtime code on the path)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array(list(prompt))[None], cache=cache)[0, -1]
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(max_tokens):
        top2 = cast("list[float]", mx.sort(logits.astype(mx.float32))[-2:].tolist())
        token = cast("int", mx.argmax(logits).tolist())  # a 0-d array: one int
        margins.append(top2[1] - top2[0])
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return Reference(tuple(tokens), tuple(margins))


def cache_kinds(model: Any) -> str:
    """The model's mlx-lm cache classes, nested ones in parentheses (``CacheList(A, B)``)."""
    from mlx_lm.models.cache import make_prompt_cache

    def name(cache: Any) -> str:
        inner = getattr(cache, "caches", None)
        if isinstance(inner, (list, tuple)):
            return f"{type(cache).__name__}({', '.join(name(c) for c in inner)})"
        return type(cache).__name__

    return ", ".join(sorted({name(c) for c in make_prompt_cache(model)}))


@dataclass(frozen=True)
class Entry:
    """A cached state: its tokens and, when it cannot be trimmed, where it can be restored."""

    tokens: tuple[int, ...]
    trimmable: bool
    restorable: frozenset[int]


@dataclass
class ReuseOracle:
    """One namespace's prefix cache, predicted: what each prompt reuses, and the path it takes.

    ``checkpointing``: the model's reuse path is ``checkpoint`` (its caches do not trim).
    ``spacing``: the periodic checkpoint spacing its prefills use. ``decode``: the tokenizer's
    decode, which finds the word boundary ``plan_checkpoints`` snapshots at. ``take_tail``: the
    backend's ``ModelInfo.take_tail_tokens`` (-1: it never takes; docs/reuse.md, "Taking an entry
    instead of copying it").
    """

    checkpointing: bool
    spacing: int
    decode: Callable[[Sequence[int]], str]
    take_tail: int = -1
    entries: list[Entry] = field(default_factory=list)

    def take(self, prompt: Sequence[int], reused: int, taken: bool) -> None:
        """Check a generate's ``Started.taken`` (looked up against the entries as they were) and
        drop the entry it took: of those serving ``reused`` tokens, one losing at most
        ``take_tail`` of its own, a whole one first, else the latest."""
        prompt = tuple(prompt)
        takeable = [
            e
            for e in self.entries
            if reused
            and self._serves(e, prompt)[0] == reused
            and len(e.tokens) - reused <= self.take_tail
        ]
        assert taken == bool(takeable), f"taken {taken}, expected {takeable!r}"
        if takeable:
            whole = [e for e in takeable if len(e.tokens) == reused]
            self.entries.remove((whole or takeable)[-1])

    @staticmethod
    def _serves(entry: Entry, prompt: tuple[int, ...]) -> tuple[int, str]:
        """Tokens ``entry`` alone serves ``prompt``, and the path."""
        limit = len(prompt) - 1
        if entry.trimmable:
            n = min(common_prefix_length(entry.tokens, prompt), limit)
            return n, "exact" if n == len(entry.tokens) else "trim"
        fits = (p for p in entry.restorable if p <= limit and entry.tokens[:p] == prompt[:p])
        return max(fits, default=0), "checkpoint"

    def reusable(self, prompt: Sequence[int]) -> tuple[int, set[str]]:
        """Tokens a lookup of ``prompt`` reuses (at most all but its last) and the reuse paths
        that may serve them (``Started.path`` values)."""
        prompt = tuple(prompt)
        best, paths = 0, {"miss"}
        for entry in self.entries:
            n, path = self._serves(entry, prompt)
            # A whole entry is "exact" where the engine kept it as it is (a state that could still
            # be trimmed when it was committed: llama4's chunked cache before its front drops).
            found = {path, "exact"} if path == "checkpoint" and n == len(entry.tokens) else {path}
            if n > best:
                best, paths = n, found
            elif n == best > 0:
                paths |= found
        return best, paths

    def snapshots(self, prompt: Sequence[int], start: int) -> set[int]:
        """Where a prefill of ``prompt`` from ``start`` snapshots (none on a trimmable model)."""
        if not self.checkpointing:
            return set()
        rule = CheckpointRule(self.spacing, MAX_POINTS)
        return set(plan_checkpoints(prompt, start, len(prompt), self.decode, rule))

    def generated(self, prompt: Sequence[int], output: Sequence[int], reused: int) -> None:
        """Record a generate that ran out of ``max_tokens``: its last token was never fed."""
        self.commit((*prompt, *output[:-1]), self.snapshots(prompt, reused))

    def aborted(self, prompt: Sequence[int], reused: int, stopped_at: int) -> None:
        """Record a prefill cancelled once ``stopped_at`` tokens were in."""
        taken = {p for p in self.snapshots(prompt, reused) if p < stopped_at}
        self.commit(prompt[:stopped_at], taken)

    def commit(self, tokens: Sequence[int], snapshots: set[int]) -> None:
        restorable = frozenset() if not self.checkpointing else frozenset({*snapshots, len(tokens)})
        self.entries.append(Entry(tuple(tokens), not self.checkpointing, restorable))
