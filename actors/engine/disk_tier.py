"""The engine's side of the disk tier: spill evicted entries, read entries back for lookups.

An entry the KV budget evicts (``DropEntries(spill=True)``) gives its bytes back at once; a compute
job hands out host views of its arrays (no copy) and the engine's I/O thread writes the file. A
lookup whose prompt the disk holds more of than RAM waits in ``LOADING`` while the I/O thread reads
and checks the file (its abort flag stops the read between arrays), then restores as from a RAM
entry. A file that fails a check is dropped and counted, and the sequence restores what RAM had, or
nothing. A clean unload writes the entries still in RAM within ``DiskCacheConfig.shutdown_s``.

See docs/design.md, "The disk tier".
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from actors.engine.entries import Kept, RestoreSource
from actors.engine.sequence import Phase, Sequence
from runtime.backends.contract import Backend
from runtime.backends.disk import (
    DiskCacheConfig,
    DiskMatch,
    DiskStore,
    EntryInvalid,
    HostState,
    LoadAborted,
    Persistent,
    WriteOutcome,
    persistent,
)
from runtime.backends.disk.entry_file import entry_name
from runtime.backends.disk.store import usable
from runtime.kernel.core import PREFIX_CACHE, Context
from runtime.kernel.stats import Counters
from runtime.messages import DiskDone, ReleaseLease, ReusePath

log = logging.getLogger("mlx_actor_runtime.disk")


@dataclass(eq=False)
class ScanJob:
    """Open the store: the model's fingerprint, then the headers of its files."""

    store: DiskStore | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class WriteJob:
    """Write one exported entry; skipped once ``deadline`` (a shutdown's) has passed."""

    kept: Kept
    host: HostState
    deadline: float | None = None
    outcome: WriteOutcome | None = None
    skipped: bool = False


@dataclass(eq=False)
class ReadJob:
    """Read ``match`` back for sequence ``sequence_id`` and make its state (or say why not)."""

    sequence_id: int
    match: DiskMatch
    source: RestoreSource | None = None
    failure: str | None = None
    aborted: bool = False
    seconds: float = 0.0


@dataclass(eq=False)
class DeleteJob:
    """Delete the files a reset put out of service."""

    paths: list[Path]


@dataclass(eq=False)
class ExportJob:
    """A compute job: host views of entries about to be written (``Persistent.export_state``)."""

    kept: list[Kept]
    deadline: float | None = None
    hosts: list[HostState] = field(default_factory=list)
    error: BaseException | None = None


DiskJob = WriteJob | ReadJob | DeleteJob

_COUNTERS = (
    "disk_scans",
    "disk_spills",
    "disk_spill_skipped",
    "disk_spill_held",
    "disk_write_failed",
    "disk_lookups",
    "disk_hits",
    "disk_hits_in_flight",  # served from an evicted entry whose write had not finished
    "disk_load_ms",
    "disk_loads_aborted",
    "disk_load_failed",
    "disk_evictions",
    "disk_dropped",  # files that failed a check (at a scan or a read), deleted
    "disk_flush_skipped",
    "disk_reset_entries",
)


class DiskTier:
    """The disk store of one engine (None until its scan is done, or when off), its jobs."""

    def __init__(self, config: DiskCacheConfig | None, counters: Counters, pending_cap: int):
        self._config = config
        self._counters = counters
        for name in _COUNTERS:
            counters.inc(name, 0)
        self._cap = pending_cap  # bytes awaiting a write, beyond the KV budget
        self._pending = 0
        self._store: DiskStore | None = None
        self._persistent: Persistent | None = None
        self._jobs: dict[int, DiskJob] = {}
        # Evicted entries not written yet, by file name: their arrays are alive until written, so
        # a lookup serves from them (a request's reservation may evict the very entry it needs).
        self._in_flight: dict[str, Kept] = {}
        self._exports = 0
        self._next_id = 1
        self.flushed = False

    @property
    def busy(self) -> bool:
        """Whether an export, write or read is in flight (an unload waits for them)."""
        return bool(self._jobs) or self._exports > 0

    def gauges(self) -> dict[str, int]:
        return {} if self._store is None else self._store.gauges()

    # ------------------------------------------------------------------ opening

    def open(self, backend: Backend) -> ScanJob | None:
        """On the compute thread, right after the load: the model's fingerprint and the index of
        its files (headers only: milliseconds), so the first lookup already sees them. None
        when the tier is off or the backend cannot persist states."""
        model = persistent(backend)
        if self._config is None or model is None:
            return None
        job = ScanJob()
        try:
            fingerprint = model.fingerprint()
            job.store = DiskStore(
                Path(self._config.directory), fingerprint, self._config.budget_bytes
            )
            job.store.scan()
        except Exception as exc:  # an unreadable folder: the tier stays off, logged
            job.error, job.store = exc, None
        return job

    def opened(self, job: ScanJob | None, backend: Backend | None) -> None:
        """The load's scan came back: the tier is on from now (or stays off, logged)."""
        self._persistent = None if backend is None else persistent(backend)
        if job is None:
            return
        if job.error is not None:
            log.warning("prefix cache: the disk tier is off: %r", job.error)
        self._store = job.store
        self._counters.inc("disk_scans")
        for name, count in ({} if job.store is None else job.store.counters).items():
            self._counters.inc(name, count)  # files the scan found bad and deleted

    # ------------------------------------------------------------------ reading back

    def better(self, seq: Sequence, matched: int) -> DiskMatch | None:
        """A disk entry reusing more of ``seq``'s prompt than the ``matched`` tokens RAM has."""
        if self._store is None or seq.tokens is None:
            return None
        self._counters.inc("disk_lookups")
        found = self._store.best(seq.namespace, seq.tokens)
        prompt, limit = tuple(seq.tokens), len(seq.tokens) - 1
        for name, kept in self._in_flight.items():
            if kept.namespace != seq.namespace:
                continue
            points = tuple(sorted(kept.points))
            n = usable(tuple(kept.tokens), kept.trimmable, points, prompt, limit)
            if n > 0 and (found is None or n > found.matched):
                found = DiskMatch(name, tuple(kept.tokens), n, kept.trimmable)
        return found if found is not None and found.matched > matched else None

    def load(self, seq: Sequence, match: DiskMatch, ctx: Context) -> None:
        """Read ``match`` back for ``seq`` (which waits in ``LOADING``); ``ReadJob`` follows."""
        store, model = self._store, self._persistent
        assert store is not None
        assert model is not None
        job = ReadJob(seq.sequence_id, match)
        kept = self._in_flight.get(match.name)
        if kept is not None and kept.tokens == match.tokens:  # still in memory: no read needed
            snapshot = None if match.trimmable else kept.points.get(match.matched)
            job.source = RestoreSource(kept.state, snapshot)
            self._counters.inc("disk_hits_in_flight")
            self._counters.inc("disk_hits")
            self.loaded_back(job, seq, ctx)
            return
        namespace, stop = seq.namespace, seq.abort
        self._background(ctx, job, lambda: _read(job, store, model, namespace, stop))

    def loaded_back(self, job: ReadJob, seq: Sequence | None, ctx: Context) -> None:
        """A read came back for ``seq``: restore from it (or from what RAM had, if it failed)."""
        if seq is None or seq.phase is not Phase.LOADING:
            ctx.count_dead_letter("stale_disk_read")  # it ended meanwhile
            return
        seq.move(Phase.RESTORING)
        if job.source is None:
            return  # dropped and counted: the RAM hit (or a cold prefill) it had stands
        if seq.lease_id is not None:
            ctx.send(PREFIX_CACHE, ReleaseLease(lease_id=seq.lease_id))
            seq.lease_id = None
        match = job.match
        seq.restore_entry, seq.restore_length, seq.reach_length = None, match.matched, 0
        seq.disk_source, seq.from_disk, seq.cached_tokens = job.source, True, match.matched
        if not match.trimmable:
            seq.path = ReusePath.CHECKPOINT
        else:
            seq.path = ReusePath.EXACT if match.matched == len(match.tokens) else ReusePath.TRIM

    # ------------------------------------------------------------------ writing

    def spill(
        self,
        kept: list[Kept],
        submit: Callable[[ExportJob], None],
        deadline: float | None = None,
    ) -> None:
        """Write ``kept`` (evicted, or still in RAM at a shutdown) unless the disk has them."""
        store = self._store
        if store is None or not kept:
            return
        chosen = []
        for entry in kept:
            if store.holds(entry.namespace, entry.tokens):
                self._counters.inc("disk_spill_held")
            elif deadline is None and self._pending and self._pending + entry.nbytes > self._cap:
                # Writes lag: evicted memory must not pile up (one always may wait, though).
                self._counters.inc("disk_spill_skipped")
            else:
                self._pending += entry.nbytes
                self._in_flight[entry_name(entry.namespace, entry.tokens)] = entry
                chosen.append(entry)
        if chosen:
            self._exports += 1
            submit(ExportJob(chosen, deadline))

    def exported(self, job: ExportJob, ctx: Context) -> None:
        """Host views are ready: write each on the I/O thread."""
        self._exports -= 1
        if job.error is not None:
            log.warning("prefix cache: could not export entries for the disk: %r", job.error)
            self._counters.inc("disk_write_failed", len(job.kept))
            self._pending -= sum(k.nbytes for k in job.kept)
            for kept in job.kept:
                self._in_flight.pop(entry_name(kept.namespace, kept.tokens), None)
            return
        store = self._store
        assert store is not None
        for kept, host in zip(job.kept, job.hosts, strict=True):
            write = WriteJob(kept, host, job.deadline)
            self._background(ctx, write, lambda w=write: _write(w, store))  # type: ignore[misc]

    def forget(self, namespace: str | None, ctx: Context) -> None:
        """A reset of this model (``namespace`` None: every one): its files serve nothing from
        now on, and are deleted on the I/O thread."""
        if self._store is None:
            return
        paths = self._store.forget(namespace)
        self._counters.inc("disk_reset_entries", len(paths))
        if paths:
            job = DeleteJob(paths)
            self._background(ctx, job, lambda: _delete(paths))

    def flush(self, kept: list[Kept], submit: Callable[[ExportJob], None]) -> None:
        """A clean unload: write what RAM still holds, within ``shutdown_s``; once."""
        self.flushed = True
        if self._config is not None:
            self.spill(kept, submit, time.monotonic() + self._config.shutdown_s)

    # ------------------------------------------------------------------ jobs

    def done(self, message: DiskDone) -> DiskJob | None:
        """The job ``message`` reports (None: not this tier's), its counters applied."""
        job = self._jobs.pop(message.job_id, None)
        match job:
            case WriteJob(kept=kept, outcome=outcome, skipped=skipped):
                self._pending -= kept.nbytes
                self._in_flight.pop(entry_name(kept.namespace, kept.tokens), None)
                if skipped:
                    self._counters.inc("disk_flush_skipped")
                elif outcome is not None and outcome.written:
                    self._counters.inc("disk_spills")
                    self._counters.inc("disk_evictions", outcome.evicted)
                else:
                    self._counters.inc("disk_write_failed")
                    if outcome is not None and outcome.failure != "disk_write_failed":
                        self._counters.inc(outcome.failure or "disk_write_failed_other")
            case ReadJob(source=source, failure=failure, aborted=aborted, seconds=seconds):
                if aborted:
                    self._counters.inc("disk_loads_aborted")
                elif source is None:
                    self._counters.inc("disk_load_failed")
                    self._counters.inc(failure or "disk_read_failed")
                    if failure not in (None, "disk_missing", "disk_read_failed"):
                        self._counters.inc("disk_dropped")
                else:
                    self._counters.inc("disk_hits")
                    self._counters.inc("disk_load_ms", round(seconds * 1000))
            case DeleteJob() | None:
                pass
        return job

    def _background(self, ctx: Context, job: DiskJob, work: Callable[[], None]) -> None:
        job_id, self._next_id = self._next_id, self._next_id + 1
        self._jobs[job_id] = job
        ctx.background(work, DiskDone(job_id=job_id))


def run_export(job: ExportJob, backend: Backend) -> None:
    """On the compute thread: host views of each entry (``Persistent.export_state``)."""
    model = persistent(backend)
    try:
        assert model is not None
        job.hosts = [model.export_state(k.state, k.points) for k in job.kept]
    except BaseException as exc:
        job.error = exc


def _write(job: WriteJob, store: DiskStore) -> None:
    if job.deadline is not None and time.monotonic() > job.deadline:
        job.skipped = True
        return
    try:
        job.outcome = store.write(job.kept.namespace, job.kept.tokens, job.kept.trimmable, job.host)
    except Exception as exc:  # e.g. arrays the format cannot hold: counted, never fatal
        log.warning("prefix cache: could not write an entry: %r", exc)


def _delete(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def _read(
    job: ReadJob, store: DiskStore, model: Persistent, namespace: str, stop: threading.Event
) -> None:
    started = time.monotonic()
    try:
        host = store.read(job.match, namespace, stop)
        state, snapshots = model.import_state(host)
        snapshot = snapshots.get(job.match.matched) if not job.match.trimmable else None
        job.source = RestoreSource(state, snapshot)
    except LoadAborted:
        job.aborted = True
    except EntryInvalid as bad:
        job.failure = bad.reason
    except ValueError:  # a layout this model cannot make back: as good as corrupt
        job.failure = "disk_corrupt"
    except Exception as exc:
        log.warning("prefix cache: could not read an entry back: %r", exc)
        job.failure = "disk_read_failed"
    job.seconds = time.monotonic() - started
