"""Continuous batching inside one engine: who decodes in the shared batch, and who leaves it.

One decoding sequence runs alone on the B=1 fast path; two or more share one decode batch. A
sequence joins at the next batch step after it sampled its first token, and leaves at the next
step after it ended (its state must come back out before its memory is released) or when the
batch drains to one (that one goes back to the fast path). The engine owns one ``BatchScheduler``
and acts on what it reports; the scheduler never ends a sequence itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from actors.engine_jobs import BatchWork, Job
from runtime.backend import DecodeBatchHandle
from runtime.messages import ModelSpec
from runtime.sequence import Phase, Sequence
from runtime.stats import Counters

DEFAULT_MAX_BATCH = 8


@dataclass
class Leaving:
    """A batched sequence that ended (or returns to B=1); its state comes back at the next step."""

    seq: Sequence
    detach: bool  # commit its state to the prefix cache once it is back
    resume: bool = False  # it goes on decoding alone


@dataclass
class BatchStepDone:
    """What a finished batch step leaves for the engine to act on."""

    # Sequences whose state came back out; None: aborted while it waited for this step.
    returned: list[tuple[Sequence, Leaving | None]] = field(default_factory=list)
    stepped: list[tuple[Sequence, Job]] = field(default_factory=list)  # members and their token
    failed: list[Sequence] = field(default_factory=list)  # live members of a batch that raised
    orphaned: list[Sequence] = field(default_factory=list)  # ended; their state went with it


class BatchScheduler:
    """Membership of an engine's decode batch (see module docstring)."""

    def __init__(self, spec: ModelSpec, counters: Counters) -> None:
        self.enabled = spec.options.get("batching", True) is not False
        max_batch = spec.options.get("max_batch", DEFAULT_MAX_BATCH)
        self._max_batch = max_batch if isinstance(max_batch, int) else DEFAULT_MAX_BATCH
        self._counters = counters
        self.handle: DecodeBatchHandle | None = None
        self._members: dict[int, Sequence] = {}  # slot -> sequence
        self._leaving: dict[int, Leaving] = {}  # sequences whose state is still in the batch
        self._ran_last = False

    def __len__(self) -> int:
        return len(self._members)

    @property
    def has_leaving(self) -> bool:
        """Whether some ended sequence's state is still in the batch (its memory not yet free)."""
        return bool(self._leaving)

    def leave_later(self, seq: Sequence, detach: bool) -> None:
        """``seq`` ended while batched: it leaves at the next step, then the engine releases it."""
        self._leaving[seq.sequence_id] = Leaving(seq, detach)

    # ------------------------------------------------------------------ planning a step

    def work(self, sequences: Iterable[Sequence]) -> BatchWork | None:
        """What the next batch step would do, or None when nothing calls for batching."""
        if not self.enabled:
            return None
        leavers = [leaving.seq for leaving in self._leaving.values()]
        members = [s for s in self._members.values() if s.sequence_id not in self._leaving]
        joinable = [
            s
            for s in sequences
            if s.phase is Phase.DECODING
            and s.batch_slot is None
            and s.pending_token is not None
            and not s.abort.is_set()
        ]
        joiners: list[Sequence] = []
        if len(members) + len(joinable) >= 2:
            joiners = joinable[: max(0, self._max_batch - len(members))]
        elif len(members) == 1:  # the batch drained to one: it goes back to the fast path
            self._leaving[members[0].sequence_id] = Leaving(members[0], False, resume=True)
            leavers.append(members[0])
            members = []
        if not (leavers or joiners or members):
            return None
        return BatchWork(leavers=leavers, joiners=joiners, members=members)

    def takes_turn(self, work: BatchWork | None, others_ready: bool) -> bool:
        """Whether the batch steps now. A newcomer's prefill chunk and a batch step take turns,
        so neither starves the other."""
        self._ran_last = work is not None and (not others_ready or not self._ran_last)
        return self._ran_last

    # ------------------------------------------------------------------ after a step

    def done(self, job: Job) -> BatchStepDone:
        """Record who left and joined in ``job``; report what the engine must act on."""
        assert job.work is not None
        self.handle = job.batch
        self._counters.inc("batch_steps", 1 if job.stepped else 0)
        self._counters.inc("batch_joins", len(job.joined))
        self._counters.inc("batch_leaves", len(job.left))
        self._counters.inc("batched_tokens", len(job.stepped))
        result = BatchStepDone()
        for seq_id, state in job.left.items():
            leaving = self._leaving.pop(seq_id, None)
            seq = leaving.seq if leaving is not None else self._member(seq_id)
            assert seq.batch_slot is not None
            del self._members[seq.batch_slot]
            seq.batch_slot, seq.state, seq.in_compute = None, state, False
            result.returned.append((seq, leaving))
        joiners = {s.sequence_id: s for s in job.work.joiners}
        for seq_id, slot in job.joined.items():
            seq = joiners[seq_id]
            seq.batch_slot, seq.state = slot, None  # its cache lives in the batch now
            self._members[slot] = seq
        if job.error is not None:
            self._failed(result)
            return result
        for seq in self._members.values():
            step = job.stepped.get(seq.sequence_id)
            if step is not None:
                result.stepped.append((seq, step))
        return result

    def _member(self, seq_id: int) -> Sequence:
        return next(s for s in self._members.values() if s.sequence_id == seq_id)

    def _failed(self, result: BatchStepDone) -> None:
        """A batch step raised: its cache cannot be trusted, so every member fails and it goes."""
        members, self._members, self.handle = list(self._members.values()), {}, None
        for seq in members:
            seq.batch_slot, seq.state, seq.in_compute = None, None, False
            if seq.phase is not Phase.DONE:
                result.failed.append(seq)
        for leaving in self._leaving.values():
            leaving.seq.batch_slot = None
            if not leaving.resume:  # one going back to B=1 is live: it fails with the members
                result.orphaned.append(leaving.seq)
        self._leaving.clear()
