"""A loaded model's capabilities: the load probe's verdict (cached or run) applied to the backend.

A capability the probe found wrong is switched off for this model only: batched decoding off
makes ``open_batch`` give None (streams are served one at a time); batched prefill off keeps the
engine from prefilling prompts together (``ModelInfo.capable``); a snapshot that cannot reach back
inside a pass makes the backend cut its passes at snapshot points; trimming off makes reuse
restore checkpoints that copy every layer; checkpoints that do not restore exactly even so leave
the model with no prefix reuse. The load log line says what is off and why; ``ModelInfo.limits``
carries the same to ``/v1/models``, ``stats()`` and ``/metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from runtime.backends.contract import Capability, ModelInfo, ReuseStrategy
from runtime.backends.mlx.batch import DecodeBatch
from runtime.backends.mlx.probe import (
    PROBE_PROMPT_TOKENS,
    Declared,
    ProbedBackend,
    ProbeResult,
    run_probe,
)
from runtime.backends.mlx.state import MlxState
from runtime.backends.mlx.together import together_snapshot_tokens
from runtime.backends.mlx.verdicts import cached, fingerprint, store

log = logging.getLogger("mlx_actor_runtime.mlx_backend")


def limit_by_probe(
    backend: ProbedBackend, name: str, caches: Sequence[Any], first: MlxState | None = None
) -> ModelInfo:
    """``backend.info`` as measured, limited by the probe's verdict on this model: the cached
    one for its fingerprint, else the probe's run now (then cached). ``first``: the probe's
    first prompt run alone, where the load's warm-up pass was that run (``probe.plain_run``)."""
    info = backend.info
    key = fingerprint(backend.path, backend.kv_bits, caches) if backend.path.is_dir() else None
    result = None if key is None else cached(key)
    from_cache = result is not None
    if result is None:
        declared = Declared(
            reach_back=backend.reach_back,
            checkpoints=info.reuse is ReuseStrategy.CHECKPOINT,
            trims=info.reuse is ReuseStrategy.TRIM,
            batch_refusal=DecodeBatch.unsupported_reason(backend),
            together_points=info.reuse is ReuseStrategy.CHECKPOINT
            and info.together_snapshot_tokens >= PROBE_PROMPT_TOKENS,
        )
        result = run_probe(backend, declared, info.vocab_size, first)
        if key is not None:
            store(key, result)
    limited = apply_verdict(backend, info, caches, result, from_cache)
    log.info(
        "model %r: load probe %s: %s",
        name,
        "verdict cached" if from_cache else f"ran in {result.seconds:.2f} s",
        "; ".join(f"{c} off ({why})" for c, why in limited.limits.items()) or "every capability on",
    )
    return limited


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
    )
