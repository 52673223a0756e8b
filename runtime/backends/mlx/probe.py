"""The load probe: what a model may do, decided by evidence on the loaded model itself.

Reuse and batching must never change what a model says, but whether they keep that promise
depends on each architecture's code in mlx-lm, not only on its cache classes. So at load, a few
dozen deterministic tokens go through each path the engine would use (snapshot reach-back,
batched prefill, batched decode, trim) and their logits are compared with a plain run of the same
tokens; a path that differs, or crashes, is switched off. The verdict is cached by the model's
fingerprint (verdicts.py), so only a model's first load pays for it.

Each check and what failing it switches off: docs/models.md, "The load probe's checks".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten

from runtime.backends.contract import Capability, Verdict

if TYPE_CHECKING:
    from pathlib import Path

    from runtime.backends.contract import ModelInfo
    from runtime.backends.mlx.state import MlxSnapshot, MlxState


class ProbedBackend(Protocol):
    """What the probe and its verdict use of the backend (``MlxBackend`` is the one; named
    here so this module need not import it, which imports this one)."""

    reach_back: bool
    whole_snapshots: bool
    batch_decode: bool
    info: ModelInfo  # set while a deferred probe runs a piece (capabilities.py)

    @property
    def path(self) -> Path: ...

    @property
    def kv_bits(self) -> int | None: ...

    @property
    def model(self) -> Any: ...

    def new_state(self) -> MlxState: ...

    def prefill(
        self,
        state: Any,
        token_ids: Sequence[int],
        *,
        logits: bool = True,
        snapshot_at: Sequence[int] = (),
    ) -> list[MlxSnapshot]: ...

    def prefill_together(
        self,
        states: Sequence[Any],
        token_ids: Sequence[Sequence[int]],
        snapshot_at: Sequence[Sequence[int]] = (),
    ) -> list[list[MlxSnapshot]]: ...

    def copy_state(self, state: Any, length: int, snapshot: Any = None) -> MlxState: ...

    def can_trim(self, state: Any) -> bool: ...

    def logits(self, state: Any) -> mx.array: ...

    def feed(self, state: Any, token: mx.array) -> mx.array: ...


# Bump whenever a check or a workaround changes: cached verdicts of older probes are ignored.
PROBE_VERSION = 10
# Prompt lengths: the rows of a batched pass padded differently. Each prompt is run alone once
# (the baseline every check compares with; the first is the load's warm-up run); the checks add
# 7-10 more short passes (SmolLM2 and Gemma 3: 9 and 12 passes in all, the load's 9 apart).
_ROWS = (5, 12)
PROBE_PROMPT_TOKENS = max(_ROWS)  # a batched pass must take snapshots this far in to be checked
_PREFIX = 3  # the last row of the batched prefill starts from a cached prefix of this many
# Snapshot points of the batched prefill: one where the padded pass is cut, one a token before
# its row's end (taken between the padded pass and the last tokens' pass: together.py).
_TOGETHER_AT: tuple[tuple[int, ...], ...] = ((3,), (11,))
_INSIDE = 7  # where the last prompt is snapshotted inside its pass, and trimmed back to


class ProbeResult(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The verdicts, whether checkpoints restore exactly at all, and what the probe cost."""

    verdicts: tuple[Verdict, ...]
    checkpoints_exact: bool
    seconds: float


class Declared(msgspec.Struct, frozen=True, kw_only=True):
    """What the cache classes allow, before any evidence: the probe checks only these."""

    reach_back: bool  # every untrimmable layer can be snapshotted inside a pass
    checkpoints: bool  # reuse restores checkpoints (some layer does not trim)
    trims: bool  # every layer trims
    batch_refusal: str | None  # why mlx-lm cannot batch the caches (None: it can)
    together_points: bool  # a batched pass takes snapshots inside the probe's prompts


def run_probe(
    backend: ProbedBackend, declared: Declared, vocab_size: int, first: MlxState | None = None
) -> ProbeResult:
    """Check every declared capability on ``backend``'s model (``ProbeResult``), all at once.
    ``first``: the first prompt's plain run (``plain_run(backend, probe_prompts(vocab_size)[0])``)
    where the load already made it (its warm-up pass): not run again."""
    steps = probe_steps(backend, declared, vocab_size, first)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(ProbeResult, done.value)


def probe_steps(
    backend: ProbedBackend, declared: Declared, vocab_size: int, first: MlxState | None = None
) -> Generator[None, None, ProbeResult]:
    """``run_probe`` in pieces of a few short passes each: it yields between its checks, so an
    engine that runs it in the background (capabilities.py) serves a request between two pieces.
    ``ProbeResult.seconds`` counts the pieces' own time, not the waits between them."""
    spent = 0.0
    start = time.perf_counter()
    tol = _tolerance(backend.model)
    prompts = probe_prompts(vocab_size)
    base = _Baseline(backend, prompts, declared, first)
    spent += time.perf_counter() - start
    yield
    start = time.perf_counter()
    trim = _trim(backend, declared, base, tol)
    if declared.trims and not trim.on:  # the fallback: checkpoints that copy every layer
        backend.whole_snapshots = True
        declared = msgspec.structs.replace(declared, checkpoints=True, reach_back=False)
    spent += time.perf_counter() - start
    yield
    start = time.perf_counter()
    reach, exact = _snapshots(backend, declared, base, tol)
    spent += time.perf_counter() - start
    yield
    start = time.perf_counter()
    together = _batch_prefill(backend, declared, base, tol)
    spent += time.perf_counter() - start
    yield
    start = time.perf_counter()
    decode = _batch_decode(backend, declared, base, tol)  # last: it extends the baseline's states
    spent += time.perf_counter() - start
    return ProbeResult(
        verdicts=(reach, together, decode, trim), checkpoints_exact=exact, seconds=spent
    )


def probe_prompts(vocab_size: int) -> list[list[int]]:
    """Deterministic token ids, away from the special tokens at the start of most vocabularies."""
    low = 5 if vocab_size > 64 else 0
    span = max(2, min(vocab_size or 512, 1024) - low)
    return [[low + (7 * i + 3 + 11 * row) % span for i in range(n)] for row, n in enumerate(_ROWS)]


class _Baseline:
    """Each prompt run alone, in one pass: its state and logits (and, on a model that restores
    checkpoints, the last one's snapshot inside that pass)."""

    def __init__(
        self,
        backend: ProbedBackend,
        prompts: list[list[int]],
        declared: Declared,
        first: MlxState | None,
    ) -> None:
        self.prompts = prompts
        self.states = []
        self.snapshots: dict[int, Any] = {}  # the last prompt's, by point
        for row, prompt in enumerate(prompts):
            if row == 0:  # never snapshotted: only the last row is
                if first is None:
                    first = plain_run(backend, prompt)
                elif first.n_tokens != len(prompt) or first.logits is None:
                    raise ValueError("the first prompt's plain run is not this probe's")
                self.states.append(first)
                continue
            state = backend.new_state()
            at = (_INSIDE,) if declared.checkpoints and row == len(prompts) - 1 else ()
            taken = _extend(backend, state, prompt, at)
            self.states.append(state)
            self.snapshots = dict(zip(at, taken, strict=True)) or self.snapshots
        self.logits = [backend.logits(state) for state in self.states]
        self.scale = max(float(mx.max(mx.abs(logits))) for logits in self.logits)

    @property
    def last(self) -> tuple[list[int], Any, mx.array]:
        """The longest prompt, its state and its logits."""
        return self.prompts[-1], self.states[-1], self.logits[-1]


def plain_run(backend: ProbedBackend, prompt: Sequence[int]) -> MlxState:
    """The first prompt's baseline: run alone on a new state, its last token a pass of its own
    (``_extend``: one pass projecting all 5 positions costs 2x the pair on the quantized real
    models, 0.7-0.95x on float32 ones; measured). The load's warm-up is this run, which the probe
    then reuses."""
    state = backend.new_state()
    _extend(backend, state, prompt)
    return state


def _extend(
    backend: ProbedBackend, state: Any, ids: Sequence[int], snapshot_at: Sequence[int] = ()
) -> Sequence[Any]:
    """``prefill`` with the last token as a pass of its own, as the backend runs a long prompt:
    only that token is projected onto the vocabulary (a whole short pass projected costs more
    than the rest of the probe on a quantized 262k-token vocabulary: measured on Gemma 3)."""
    end = state.length + len(ids)
    if len(ids) == 1:
        return backend.prefill(state, ids, snapshot_at=snapshot_at)
    taken = list(
        backend.prefill(
            state, ids[:-1], logits=False, snapshot_at=[p for p in snapshot_at if p < end]
        )
    )
    taken += backend.prefill(state, ids[-1:], snapshot_at=[p for p in snapshot_at if p == end])
    return taken


def _tolerance(model: Any) -> float:
    """Relative logit tolerance: float32 arithmetic reordered by batching stays within ~1e-5 of
    the logits' scale; half precision within a few 1e-3. Defects measured 0.1 and up."""
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    half = any(p.dtype in (mx.float16, mx.bfloat16) for _, p in params)
    return 3e-2 if half else 1e-3


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)))


def _checked(
    capability: Capability, tol: float, scale: float, check: Callable[[], float], ok: str
) -> Verdict:
    """Run ``check`` (the largest logit difference it measured against a plain run)."""
    try:
        diff = check()
    except Exception as exc:  # any failure of the path is the finding, not a load failure
        why = f"crashed on this model ({type(exc).__name__}: {exc})"
        return Verdict(capability=capability, on=False, why=why)
    if diff <= tol * max(1.0, scale):
        return Verdict(capability=capability, on=True, why=ok, max_diff=diff)
    why = f"differs from a plain run by up to {diff:.3g} in the logits on this model"
    return Verdict(capability=capability, on=False, why=why, max_diff=diff)


def _restored_diff(
    backend: ProbedBackend, source: Any, prompt: Sequence[int], point: int, snapshot: Any
) -> float:
    """How far ``source``'s snapshot at ``point``, restored and extended, ends from its logits."""
    restored = backend.copy_state(source, point, snapshot)
    _extend(backend, restored, prompt[point:])
    return _diff(backend.logits(restored), backend.logits(source))


def _snapshots(
    backend: ProbedBackend, declared: Declared, base: _Baseline, tol: float
) -> tuple[Verdict, bool]:
    cap = Capability.SNAPSHOT_REACH_BACK
    if not declared.checkpoints:
        return Verdict(capability=cap, on=True, why="every layer trims: no snapshot needed"), True
    prompt, state, _ = base.last

    def from_base() -> float:  # the baseline's pass reached back to its snapshot
        return _restored_diff(backend, state, prompt, _INSIDE, base.snapshots[_INSIDE])

    def cut() -> float:  # a pass cut at the snapshot point
        full = backend.new_state()
        (snapshot,) = _extend(backend, full, prompt, (_INSIDE,))
        return _restored_diff(backend, full, prompt, _INSIDE, snapshot)

    cut_ok = "passes are cut at snapshot points"
    if declared.reach_back:
        verdict = _checked(cap, tol, base.scale, from_base, "a snapshot inside a pass is exact")
        if verdict.on:
            return verdict, True
        backend.reach_back = False  # the fallback: is a snapshot at a pass's end exact?
        fallback = _checked(cap, tol, base.scale, cut, cut_ok)
        backend.reach_back = True
        why = f"a snapshot inside a pass {verdict.why.split(' ', 1)[1]}; {cut_ok}"
        return Verdict(capability=cap, on=False, why=why, max_diff=verdict.max_diff), fallback.on
    # The baseline's pass was cut at its snapshot, unless it was taken before whole snapshots.
    fallback = _checked(cap, tol, base.scale, cut if backend.whole_snapshots else from_base, cut_ok)
    why = "a recurrent layer keeps only its last step: " + cut_ok
    return Verdict(capability=cap, on=False, why=why, max_diff=fallback.max_diff), fallback.on


def _cached_prefix(backend: ProbedBackend, base: _Baseline) -> Any:
    """The last prompt's first tokens as prefix reuse finds them: its plain run cut back where
    its layers trim (every attention layer, a sliding ring not yet wrapped; not after the trim
    check failed: every snapshot is then whole), else run anew. Cut back, it costs no pass."""
    prompt, state, _ = base.last
    if backend.can_trim(state):
        return backend.copy_state(state, _PREFIX)
    fresh = backend.new_state()
    backend.prefill(fresh, prompt[:_PREFIX], logits=False)
    return fresh


def _batch_prefill(
    backend: ProbedBackend, declared: Declared, base: _Baseline, tol: float
) -> Verdict:
    cap = Capability.BATCH_PREFILL
    if declared.batch_refusal is not None:
        return Verdict(capability=cap, on=False, why=declared.batch_refusal)
    points = [list(p) for p in _TOGETHER_AT] if declared.together_points else []

    def check() -> float:
        states = [backend.new_state() for _ in base.prompts[:-1]]
        states.append(_cached_prefix(backend, base))
        rests = [p[s.length :] for p, s in zip(base.prompts, states, strict=True)]
        snaps = backend.prefill_together(states, rests, points)
        worst = max(
            _diff(backend.logits(s), logits) for s, logits in zip(states, base.logits, strict=True)
        )
        for row, at in enumerate(points):
            for point, snapshot in zip(at, snaps[row], strict=True):
                restored = _restored_diff(backend, states[row], base.prompts[row], point, snapshot)
                worst = max(worst, restored)
        return worst

    return _checked(cap, tol, base.scale, check, "a padded batched prefill equals each alone")


def _batch_decode(
    backend: ProbedBackend, declared: Declared, base: _Baseline, tol: float
) -> Verdict:
    from runtime.backends.mlx.batch import DecodeBatch

    cap = Capability.BATCH_DECODE
    if declared.batch_refusal is not None:
        return Verdict(capability=cap, on=False, why=declared.batch_refusal)

    def check() -> float:
        batch = DecodeBatch(backend)
        slots = [batch.join(state) for state in base.states]  # copied in: the states stay
        token = base.prompts[0][1]
        stepped = batch.step(dict.fromkeys(slots, token))
        return max(
            _diff(stepped[slot], backend.feed(state, mx.array(token)))
            for slot, state in zip(slots, base.states, strict=True)
        )

    return _checked(cap, tol, base.scale, check, "a batched decode step equals each row's own")


def _trim(backend: ProbedBackend, declared: Declared, base: _Baseline, tol: float) -> Verdict:
    cap = Capability.TRIM
    if not declared.trims:
        why = "a layer is not trimmable: reuse restores checkpoints"
        return Verdict(capability=cap, on=False, why=why)
    prompt, state, logits = base.last

    def check() -> float:
        cut = backend.copy_state(state, _INSIDE)
        _extend(backend, cut, prompt[_INSIDE:])
        return _diff(backend.logits(cut), logits)

    return _checked(cap, tol, base.scale, check, "a state cut back and extended equals a fresh run")
