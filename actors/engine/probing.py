"""The model's deferred load probe, run a piece at a time while the compute slot has nothing else.

A model's first load with no cached verdict is ready at once with every probed capability off
(``ModelInfo.probe_pending``: one stream at a time, prompts prefilled alone, no trimming or
checkpoints). Each piece is a few short passes, started only when no sequence has work, so a
request waits at most one piece behind it; the last piece gives the model's new info, which the
core applies (batching may open, checkpoints start) and reports to the router (``EngineProbed``).
A piece that raises leaves the model as it is, limited, for the rest of its epoch.
"""

from __future__ import annotations

import logging

from actors.engine.compute import ComputeSlot
from actors.engine.jobs import ProbeJob, run_probe_step
from runtime.backends.contract import Backend, DeferredProbe, ModelInfo
from runtime.kernel.core import Context
from runtime.kernel.stats import Counters

log = logging.getLogger("mlx_actor_runtime.engine")


class DeferredProbing:
    """Whether a probe is left to run, and its pieces' jobs."""

    def __init__(self, model: str, counters: Counters) -> None:
        self._model = model
        self._counters = counters
        self._probe: DeferredProbe | None = None

    @property
    def pending(self) -> bool:
        return self._probe is not None

    def loaded(self, probe: DeferredProbe | None) -> None:
        self._probe = probe

    def start(self, backend: Backend, compute: ComputeSlot, ctx: Context) -> bool:
        """Run the next piece if one is left and the slot is free (False: nothing started)."""
        if self._probe is None or compute.busy:
            return False
        job = ProbeJob(self._probe)
        compute.submit(ctx, job, lambda: run_probe_step(job, backend))
        return True

    def done(self, job: ProbeJob) -> ModelInfo | None:
        """A piece came back: the model's new info once the last is done, else None."""
        if job.error is not None:
            self._probe = None
            self._counters.inc("probe_failed")
            log.warning(
                "model %s: the deferred load probe failed (%r); its capabilities stay off",
                self._model,
                job.error,
            )
            return None
        self._counters.inc("probe_pieces")
        if job.info is not None:
            self._probe = None
        return job.info
