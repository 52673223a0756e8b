"""A loaded model's capabilities: the load probe's verdict (cached or run) applied to the backend.

A capability the probe found wrong is switched off for this model only: no batched decoding, no
batched prefill, passes cut at snapshot points, restores copying every layer, or no reuse. The load
log line says what is off and why; ``ModelInfo.limits`` carries it to ``/v1/models``, ``stats()``
and ``/metrics``. With ``MlxOptions.load_probe="background"`` (the default) a first load does not
wait for the probe: the model is served as if every capability had failed until the engine has run
the probe in pieces while idle (``DeferredProbe``) and applied its verdict.

See docs/models.md, "Capabilities".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, cast

import msgspec

from runtime.backends.contract import Capability, ModelInfo, ReuseStrategy, Verdict
from runtime.backends.mlx.batch import DecodeBatch
from runtime.backends.mlx.probe import (
    PROBE_PROMPT_TOKENS,
    Declared,
    ProbedBackend,
    ProbeResult,
    probe_steps,
    run_probe,
)
from runtime.backends.mlx.state import MlxState
from runtime.backends.mlx.together import together_snapshot_tokens
from runtime.backends.mlx.verdicts import cached, fingerprint, store

log = logging.getLogger("mlx_actor_runtime.mlx_backend")


PENDING = (
    "not yet known: the load probe runs in the background on this first load of the model, "
    "and the capability turns on once it proves exact"
)


def limit_by_probe(
    backend: ProbedBackend,
    name: str,
    caches: Sequence[Any],
    first: MlxState | None = None,
    *,
    defer: bool = False,
) -> tuple[ModelInfo, DeferredProbe | None]:
    """``backend.info`` as measured, limited by the probe's verdict on this model: the cached
    one for its fingerprint, else the probe's run now (then cached), or with ``defer`` every
    capability off until the returned ``DeferredProbe`` has run. ``first``: the probe's first
    prompt run alone, where the load's warm-up pass was that run (``probe.plain_run``)."""
    info = backend.info
    key = fingerprint(backend.path, backend.kv_bits, caches) if backend.path.is_dir() else None
    result = None if key is None else cached(key)
    if result is not None:
        return _applied(backend, name, info, caches, result, from_cache=True), None
    declared = Declared(
        reach_back=backend.reach_back,
        checkpoints=info.reuse is ReuseStrategy.CHECKPOINT,
        trims=info.reuse is ReuseStrategy.TRIM,
        batch_refusal=DecodeBatch.unsupported_reason(backend),
        together_points=info.reuse is ReuseStrategy.CHECKPOINT
        and info.together_snapshot_tokens >= PROBE_PROMPT_TOKENS,
    )
    if defer:
        deferred = DeferredProbe(backend, name, info, caches, key, declared, first)
        log.info("model %r: load probe deferred: it runs while the engine is idle", name)
        return _pending(backend, info), deferred
    result = run_probe(backend, declared, info.vocab_size, first)
    if key is not None:
        store(key, result)
    return _applied(backend, name, info, caches, result, from_cache=False), None


def _applied(
    backend: ProbedBackend,
    name: str,
    info: ModelInfo,
    caches: Sequence[Any],
    result: ProbeResult,
    *,
    from_cache: bool,
) -> ModelInfo:
    limited = apply_verdict(backend, info, caches, result, from_cache)
    log.info(
        "model %r: load probe %s: prefix reuse by %s; %s",
        name,
        "verdict cached" if from_cache else f"ran in {result.seconds:.2f} s",
        limited.reuse,
        "; ".join(f"{c} off ({why})" for c, why in limited.limits.items()) or "every capability on",
    )
    return limited


def _pending(backend: ProbedBackend, info: ModelInfo) -> ModelInfo:
    """``info`` with every capability off until the probe's verdict: the paths that need no
    evidence (whole copies of every layer, one stream at a time) are what a failed probe keeps."""
    _Flags(reach_back=False, whole_snapshots=True, batch_decode=False).put(backend)
    return msgspec.structs.replace(
        info,
        reuse=ReuseStrategy.NONE,
        reuse_reason=f"prefix reuse is {PENDING}",
        together_snapshot_tokens=0,
        capabilities=tuple(Verdict(capability=c, on=False, why=PENDING) for c in Capability),
        probe_pending=True,
    )


class _Flags(msgspec.Struct, frozen=True):
    """What the probe both reads and sets on the backend: its switches and its info."""

    reach_back: bool
    whole_snapshots: bool
    batch_decode: bool
    info: ModelInfo | None = None  # None: leave the backend's as it is

    @classmethod
    def of(cls, backend: ProbedBackend) -> _Flags:
        return cls(backend.reach_back, backend.whole_snapshots, backend.batch_decode, backend.info)

    def put(self, backend: ProbedBackend) -> None:
        backend.reach_back = self.reach_back
        backend.whole_snapshots = self.whole_snapshots
        backend.batch_decode = self.batch_decode
        if self.info is not None:
            backend.info = self.info


class DeferredProbe:
    """The load probe of a model that is already serving, run one piece at a time on its
    compute thread whenever the engine has nothing else to run (``Backend.deferred_probe``).

    Between pieces the backend serves with the pending switches (``_pending``); each piece puts
    the probe's own switches in, runs, and puts the serving ones back, so the two never mix.
    The last piece applies the verdict (and caches it) and returns the model's new info.
    """

    def __init__(
        self,
        backend: ProbedBackend,
        name: str,
        info: ModelInfo,
        caches: Sequence[Any],
        key: str | None,
        declared: Declared,
        first: MlxState | None,
    ) -> None:
        self._backend = backend
        self._name = name
        self._info = info  # as measured, before any limit
        self._caches = caches
        self._key = key
        self._probing = _Flags(declared.reach_back, False, True, info)  # as measured
        self._steps = probe_steps(backend, declared, info.vocab_size, first)

    def step(self) -> ModelInfo | None:
        """Run the next piece: None while more remain, else the info with the verdict applied.
        An exception leaves the serving switches in place (the model stays as pending)."""
        serving = _Flags.of(self._backend)
        self._probing.put(self._backend)
        try:
            next(self._steps)
        except StopIteration as done:
            result = cast(ProbeResult, done.value)
        except BaseException:
            serving.put(self._backend)
            raise
        else:
            self._probing = _Flags.of(self._backend)
            serving.put(self._backend)
            return None
        if self._key is not None:
            store(self._key, result)
        return _applied(
            self._backend, self._name, self._info, self._caches, result, from_cache=False
        )


def apply_verdict(
    backend: ProbedBackend,
    info: ModelInfo,
    caches: Sequence[Any],
    result: ProbeResult,
    from_cache: bool,
) -> ModelInfo:
    """Switch off on ``backend`` what ``result`` found wrong; ``info`` limited to match."""
    off = {v.capability for v in result.verdicts if not v.on}
    reuse, reason = info.reuse, info.reuse_reason
    if Capability.TRIM in off and reuse is ReuseStrategy.TRIM:
        backend.whole_snapshots = True
        reuse = ReuseStrategy.CHECKPOINT
        reason = "trimming proved inexact on this model: checkpoints copy every layer"
    if Capability.SNAPSHOT_REACH_BACK in off or backend.whole_snapshots:
        backend.reach_back = False
    if reuse is ReuseStrategy.CHECKPOINT and not result.checkpoints_exact:
        reuse = ReuseStrategy.NONE
        reason = "a restored checkpoint proved inexact on this model: no prefix reuse"
    backend.batch_decode = Capability.BATCH_DECODE not in off
    return msgspec.structs.replace(
        info,
        reuse=reuse,
        reuse_reason=reason,
        together_snapshot_tokens=together_snapshot_tokens(
            caches, info.context_length, backend.reach_back
        ),
        capabilities=result.verdicts,
        probe_s=result.seconds,
        probe_cached=from_cache,
        probe_pending=False,
    )
