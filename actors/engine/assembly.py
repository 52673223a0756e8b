"""How one engine's parts are put together: each is handed what it needs once, when it is built.

No part calls back into one built after it: the gate is built before the endings that let
sequences through it, the endings before admission and the step outcomes that end sequences, and
the model itself is handed over at the load (``EngineCore._hand_over``), never reached through a
callable. The parts' jobs are listed in docs/design.md ("The engine's parts").
"""

from __future__ import annotations

from dataclasses import dataclass

from actors.engine.admission import Admission
from actors.engine.batch import BatchScheduler
from actors.engine.chunking import ChunkSizer
from actors.engine.compute import ComputeSlot
from actors.engine.disk_tier import DiskTier
from actors.engine.endings import Endings
from actors.engine.entries import EntryStore
from actors.engine.gate import AdmissionLimits, Gate
from actors.engine.outcomes import StepOutcomes
from actors.engine.plan import StepPlanner
from actors.engine.probing import DeferredProbing
from actors.engine.sequence import Sequence
from actors.engine.stepping import EngineStep
from actors.engine.tidying import Tidying
from actors.engine.turns import PromptTurns
from actors.engine.watchdog import Watchdog
from runtime.backends.disk import DiskCacheConfig
from runtime.backends.options import EngineOptions
from runtime.kernel.stats import Counters


@dataclass(frozen=True)
class EngineParts:
    """The parts of one engine, sharing its table of live sequences."""

    entries: EntryStore
    disk: DiskTier
    batches: BatchScheduler
    probing: DeferredProbing
    tidying: Tidying
    sizer: ChunkSizer
    compute: ComputeSlot
    gate: Gate
    ends: Endings
    admission: Admission
    outcomes: StepOutcomes
    step: EngineStep

    @classmethod
    def build(
        cls,
        model: str,
        epoch: int,
        options: EngineOptions,
        sequences: dict[int, Sequence],
        counters: Counters,
        limits: AdmissionLimits,
        disk_config: DiskCacheConfig | None,
        kv_budget_bytes: int,
        step_timeout_s: float | None,
    ) -> EngineParts:
        entries = EntryStore(model, epoch, counters)
        # Evicted entries wait for their write beyond the KV budget: at most a quarter of it.
        disk = DiskTier(disk_config, counters, pending_cap=kv_budget_bytes // 4)
        batches = BatchScheduler(model, options, epoch, counters)
        probing = DeferredProbing(model, counters)
        tidying = Tidying(model, counters)
        sizer = ChunkSizer(limits.chunk_tokens, options.prefill_chunk_ms / 1000)
        turns = PromptTurns(options.decode_stall_ms / 1000, options.max_batch, options.batching)
        planner = StepPlanner(sizer, sequences, batches, turns)
        compute = ComputeSlot(sizer, sequences, batches, entries, planner, Watchdog(step_timeout_s))
        gate = Gate(limits, model, sequences, counters)
        ends = Endings(sequences, entries, batches, counters, gate)
        admission = Admission(
            limits, model, sequences, entries, counters, ends=ends, gate=gate, disk=disk
        )
        outcomes = StepOutcomes(sequences, entries, batches, ends, counters)
        step = EngineStep(compute, outcomes, admission, probing, tidying, disk, counters)
        return cls(
            entries, disk, batches, probing, tidying, sizer, compute, gate, ends, admission,
            outcomes, step,
        )  # fmt: skip
