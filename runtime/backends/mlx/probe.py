"""The load probe: what a model may do, decided by evidence on the loaded model itself.

Reuse and batching must never change what a model says, but whether they keep that promise
depends on each architecture's code in mlx-lm, not only on its cache classes (docs/models.md,
"Upstream defects and workarounds"). So at load, a few dozen deterministic tokens go through each
path the engine would use and their logits are compared with a plain run of the same tokens:

- ``snapshot_reach_back``: a snapshot taken inside a pass, restored and extended, equals the
  continuous run (off: passes are cut at snapshot points; if that fails too, no reuse);
- ``batch_prefill``: a left-padded batched prefill, one row from a cached prefix and cut at
  snapshot points, equals each prompt alone, snapshots included (off: prompts prefill alone);
- ``batch_decode``: a batched decode step equals each row's own step (off: one stream at a time);
- ``trim``: a state cut back and extended equals the same tokens computed anew (off: reuse
  restores whole checkpoints instead).

A check that crashes counts as failed. The verdict is cached by the model's fingerprint
(verdicts.py), so only a model's first load pays for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten

from runtime.backends.contract import Capability, Verdict

if TYPE_CHECKING:
    from runtime.backends.mlx.backend import MlxBackend

# Bump whenever a check or a workaround changes: cached verdicts of older probes are ignored.
PROBE_VERSION = 1
_ROWS = (9, 14, 21)  # prompt lengths of the batched checks: every row padded differently
PROBE_PROMPT_TOKENS = max(_ROWS)  # a batched pass must take snapshots this far in to be checked
_PREFIX = 5  # the last row starts from a cached prefix of this many tokens
_SNAPSHOT_AT = ((4,), (6, 11), (9, 17))  # points inside each row's prompt
_LONG = 24  # the single-sequence checks' prompt
_INSIDE = (8, 16)  # snapshot and trim points inside it


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


def run_probe(backend: MlxBackend, declared: Declared, vocab_size: int) -> ProbeResult:
    """Check every declared capability on ``backend``'s model (``ProbeResult``)."""
    start = time.perf_counter()
    tol = _tolerance(backend.model)
    ids = _Prompts(vocab_size)
    trim = _trim(backend, declared, ids, tol)
    if declared.trims and not trim.on:  # the fallback: checkpoints that copy every layer
        backend.whole_snapshots = True
        declared = msgspec.structs.replace(declared, checkpoints=True, reach_back=False)
    reach, exact = _snapshots(backend, declared, ids, tol)
    verdicts = (
        reach,
        _batch_prefill(backend, declared, ids, tol),
        _batch_decode(backend, declared, ids, tol),
        trim,
    )
    return ProbeResult(
        verdicts=verdicts, checkpoints_exact=exact, seconds=time.perf_counter() - start
    )


class _Prompts:
    """Deterministic token ids, away from the special tokens at the start of most vocabularies."""

    def __init__(self, vocab_size: int) -> None:
        self._low = 5 if vocab_size > 64 else 0
        self._span = max(2, min(vocab_size or 512, 1024) - self._low)

    def row(self, row: int, n: int) -> list[int]:
        return [self._low + (7 * i + 3 + 11 * row) % self._span for i in range(n)]


def _tolerance(model: Any) -> float:
    """Relative logit tolerance: float32 arithmetic reordered by batching stays within ~1e-5 of
    the logits' scale; half precision within a few 1e-3. Defects measured 0.1 and up."""
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    half = any(p.dtype in (mx.float16, mx.bfloat16) for _, p in params)
    return 3e-2 if half else 1e-3


def _diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a - b)))


def _close(diff: float, reference: mx.array, tol: float) -> bool:
    return diff <= tol * max(1.0, float(mx.max(mx.abs(reference))))


def _checked(
    capability: Capability, tol: float, check: Callable[[], tuple[float, mx.array]], ok: str
) -> Verdict:
    """Run ``check`` (the largest logit difference, and the logits it is measured against)."""
    try:
        diff, reference = check()
    except Exception as exc:  # any failure of the path is the finding, not a load failure
        why = f"crashed on this model ({type(exc).__name__}: {exc})"
        return Verdict(capability=capability, on=False, why=why)
    if _close(diff, reference, tol):
        return Verdict(capability=capability, on=True, why=ok, max_diff=diff)
    why = f"differs from a plain run by up to {diff:.3g} in the logits on this model"
    return Verdict(capability=capability, on=False, why=why, max_diff=diff)


def _restored_diff(
    backend: MlxBackend, source: Any, ids: Sequence[int], points: Sequence[int], snaps: Any
) -> float:
    """Largest difference between ``source``'s logits and each snapshot restored and extended."""
    worst = 0.0
    for point, snapshot in zip(points, snaps, strict=True):
        restored = backend.copy_state(source, point, snapshot)
        backend.prefill(restored, ids[point:])
        worst = max(worst, _diff(backend.logits(restored), backend.logits(source)))
    return worst


def _snapshots(
    backend: MlxBackend, declared: Declared, ids: _Prompts, tol: float
) -> tuple[Verdict, bool]:
    cap = Capability.SNAPSHOT_REACH_BACK
    if not declared.checkpoints:
        return Verdict(capability=cap, on=True, why="every layer trims: no snapshot needed"), True
    prompt = ids.row(0, _LONG)

    def check() -> tuple[float, mx.array]:
        full = backend.new_state()
        snaps = backend.prefill(full, prompt, snapshot_at=_INSIDE)
        return _restored_diff(backend, full, prompt, _INSIDE, snaps), backend.logits(full)

    cut_ok = "passes are cut at snapshot points"
    if declared.reach_back:
        verdict = _checked(cap, tol, check, "a snapshot inside a pass restores exactly")
        if verdict.on:
            return verdict, True
        backend.reach_back = False  # the fallback: is a snapshot at a pass's end exact?
        fallback = _checked(cap, tol, check, cut_ok)
        backend.reach_back = True
        why = f"a snapshot inside a pass {verdict.why.split(' ', 1)[1]}; {cut_ok}"
        return Verdict(capability=cap, on=False, why=why, max_diff=verdict.max_diff), fallback.on
    fallback = _checked(cap, tol, check, cut_ok)
    why = "a recurrent layer keeps only its last step: " + cut_ok
    return Verdict(capability=cap, on=False, why=why, max_diff=fallback.max_diff), fallback.on


def _batch_prefill(backend: MlxBackend, declared: Declared, ids: _Prompts, tol: float) -> Verdict:
    cap = Capability.BATCH_PREFILL
    if declared.batch_refusal is not None:
        return Verdict(capability=cap, on=False, why=declared.batch_refusal)
    prompts = [ids.row(row, n) for row, n in enumerate(_ROWS)]
    points = [list(p) for p in _SNAPSHOT_AT] if declared.together_points else []

    def check() -> tuple[float, mx.array]:
        states = [backend.new_state() for _ in prompts]
        backend.prefill(states[-1], prompts[-1][:_PREFIX])  # one row extends a cached prefix
        rests = [p[s.length :] for p, s in zip(prompts, states, strict=True)]
        snaps = backend.prefill_together(states, rests, points)
        worst, scale = 0.0, mx.array(0.0)
        for row, (prompt, state) in enumerate(zip(prompts, states, strict=True)):
            alone = backend.new_state()
            backend.prefill(alone, prompt)
            worst = max(worst, _diff(backend.logits(state), backend.logits(alone)))
            if points:
                at = points[row]
                worst = max(worst, _restored_diff(backend, state, prompt, at, snaps[row]))
            scale = mx.maximum(scale, mx.max(mx.abs(backend.logits(alone))))
        return worst, scale

    return _checked(cap, tol, check, "a padded batched prefill equals each prompt alone")


def _batch_decode(backend: MlxBackend, declared: Declared, ids: _Prompts, tol: float) -> Verdict:
    from runtime.backends.mlx.batch import DecodeBatch

    cap = Capability.BATCH_DECODE
    if declared.batch_refusal is not None:
        return Verdict(capability=cap, on=False, why=declared.batch_refusal)

    def check() -> tuple[float, mx.array]:
        states = []
        for row, n in enumerate(_ROWS):
            state = backend.new_state()
            backend.prefill(state, ids.row(row, n))
            states.append(state)
        batch = DecodeBatch(backend)
        slots = [batch.join(state) for state in states]  # copied in: the states stay as they are
        worst, scale = 0.0, mx.array(0.0)
        for token in ids.row(3, 2):
            stepped = batch.step(dict.fromkeys(slots, token))
            for slot, state in zip(slots, states, strict=True):
                alone = backend.feed(state, mx.array(token))
                worst = max(worst, _diff(stepped[slot], alone))
                scale = mx.maximum(scale, mx.max(mx.abs(alone)))
        return worst, scale

    return _checked(cap, tol, check, "a batched decode step equals each row's own step")


def _trim(backend: MlxBackend, declared: Declared, ids: _Prompts, tol: float) -> Verdict:
    cap = Capability.TRIM
    if not declared.trims:
        why = "a layer is not trimmable: reuse restores checkpoints"
        return Verdict(capability=cap, on=False, why=why)
    prompt = ids.row(0, _LONG)

    def check() -> tuple[float, mx.array]:
        full = backend.new_state()
        backend.prefill(full, prompt)
        worst = 0.0
        for point in _INSIDE:
            cut = backend.copy_state(full, point)
            backend.prefill(cut, prompt[point:])
            worst = max(worst, _diff(backend.logits(cut), backend.logits(full)))
        return worst, backend.logits(full)

    return _checked(cap, tol, check, "a state cut back and extended equals a fresh run")
