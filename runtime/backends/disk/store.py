"""A directory of disk entries for one model fingerprint: its index, LRU order and byte budget.

The index (namespace, tokens, points of each file) is read from the files' headers when the store
is opened (``scan``), so a new process finds what an earlier one wrote; from then on it follows
this process's own writes, evictions and failed reads. The byte budget covers the whole
directory, every fingerprint's folder, as another model's files share the disk: the least
recently used files go first, by modification time, which a hit refreshes (so LRU order survives
restarts and is shared by processes). Two processes may share a directory: writes are atomic
renames, and a file another process evicted while this one still lists it is a counted miss.
Every method may be called from any thread (one lock); the I/O runs on the engine's I/O thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from runtime.backends.disk.entry_file import (
    SUFFIX,
    EntryInvalid,
    entry_name,
    read_entry,
    read_header,
    write_entry,
)
from runtime.backends.disk.host import HostState
from runtime.messages import common_prefix_length

log = logging.getLogger("mlx_actor_runtime.disk")


@dataclass
class _Indexed:
    path: Path
    namespace: str
    tokens: tuple[int, ...]
    trimmable: bool
    points: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class DiskMatch:
    """A usable disk entry for a prompt: restore ``matched`` tokens of the file's ``tokens``."""

    name: str
    tokens: tuple[int, ...]
    matched: int
    trimmable: bool


@dataclass(frozen=True)
class WriteOutcome:
    """What one write did: ``written`` bytes (0: not written, ``failure`` says why)."""

    written: int = 0
    failure: str | None = None
    evicted: int = 0


class DiskStore:
    """The disk entries of one model (``fingerprint``) under ``root``, within ``budget_bytes``."""

    def __init__(self, root: Path, fingerprint: str, budget_bytes: int) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.folder = root / fingerprint[:32]
        self.budget_bytes = budget_bytes
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._index: dict[str, _Indexed] = {}
        self._full_disk_logged = False

    # ------------------------------------------------------------------ reading the directory

    def scan(self) -> None:
        """Index this fingerprint's files (headers only); drop bad ones and stale temporaries."""
        found: dict[str, _Indexed] = {}
        if self.folder.is_dir():
            for path in sorted(self.folder.iterdir()):
                if path.name.endswith(".tmp"):
                    self._remove_stale_temporary(path)
                    continue
                if not path.name.endswith(SUFFIX):
                    continue
                try:
                    header = read_header(path)
                    if header.fingerprint != self.fingerprint:
                        raise EntryInvalid("disk_wrong_model", f"{path.name}: another model's")
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue  # another process evicted it meanwhile
                except EntryInvalid as bad:
                    self._drop_file(path, bad.reason)
                    continue
                found[path.name] = _Indexed(
                    path, header.namespace, header.tokens, header.trimmable, header.points, size
                )
        with self._lock:
            self._index = found
        self._enforce_budget()

    @staticmethod
    def _remove_stale_temporary(path: Path) -> None:
        # A temporary older than a minute belongs to a writer that died (a live one renames it).
        try:
            if time.time() - path.stat().st_mtime > 60:
                path.unlink()
        except OSError:
            pass

    # ------------------------------------------------------------------ lookups (the loop)

    def best(self, namespace: str, tokens: tuple[int, ...] | list[int]) -> DiskMatch | None:
        """The entry reusing the most of ``tokens`` (at most all but the last): a trimmable one
        over any shared prefix, another whole or at one of its points."""
        limit = len(tokens) - 1
        best: DiskMatch | None = None
        prompt = tuple(tokens)
        if not prompt:
            return None
        with self._lock:  # on the event loop: a cheap filter first, then C-speed slice compares
            candidates = [
                (n, e)
                for n, e in self._index.items()
                if e.namespace == namespace and e.tokens[:1] == prompt[:1]
            ]
        for name, entry in candidates:
            matched = usable(entry.tokens, entry.trimmable, entry.points, prompt, limit)
            if matched > 0 and (best is None or matched > best.matched):
                best = DiskMatch(name, entry.tokens, matched, entry.trimmable)
        return best

    def holds(self, namespace: str, tokens: tuple[int, ...]) -> bool:
        with self._lock:
            entry = self._index.get(_name(namespace, tokens))
        return entry is not None

    # ------------------------------------------------------------------ I/O (the I/O thread)

    def write(
        self, namespace: str, tokens: tuple[int, ...], trimmable: bool, host: HostState
    ) -> WriteOutcome:
        """Write an entry, then evict to the budget. A full disk or an unwritable folder is a
        counted, logged ``failure``, never raised: the entry is simply not kept."""
        if host.nbytes > self.budget_bytes:
            self.counters["disk_too_large"] += 1
            return WriteOutcome(failure="disk_too_large")
        try:
            path, size = write_entry(
                self.folder, self.fingerprint, namespace, tokens, trimmable, host
            )
        except OSError as exc:
            self.counters["disk_write_failed"] += 1
            if not self._full_disk_logged:  # once: a full disk would log at every eviction
                self._full_disk_logged = True
                log.warning("prefix cache: cannot write to %s (%s); entries are not kept on disk "
                            "until it has room", self.folder, exc)  # fmt: skip
            return WriteOutcome(failure="disk_write_failed")
        with self._lock:
            self._index[path.name] = _Indexed(path, namespace, tokens, trimmable, host.points, size)
        self.counters["disk_writes"] += 1
        self.counters["disk_written_bytes"] += size
        return WriteOutcome(written=size, evicted=self._enforce_budget(keep=path))

    def read(
        self, match: DiskMatch, namespace: str, stop: threading.Event | None = None
    ) -> HostState:
        """The entry ``match`` names, checked (``entry_file.read_entry``). A bad or vanished file
        is dropped from the index (and the disk) and raises ``EntryInvalid``; ``LoadAborted``
        passes through."""
        with self._lock:
            entry = self._index.get(match.name)
        if entry is None:
            raise EntryInvalid("disk_missing", f"{match.name} is no longer indexed")
        try:
            host = read_entry(entry.path, self.fingerprint, namespace, match.tokens, stop)
        except FileNotFoundError:
            self._forget(match.name)
            self.counters["disk_missing"] += 1
            raise EntryInvalid("disk_missing", f"{match.name} was evicted elsewhere") from None
        except EntryInvalid as bad:
            self._drop_file(entry.path, bad.reason)
            raise
        with contextlib.suppress(OSError):  # most recently used, for every process sharing it
            os.utime(entry.path)
        return host

    def forget(self, namespace: str | None) -> list[Path]:
        """Stop serving this model's entries of ``namespace`` (None: all) at once; their paths,
        for the caller to delete off the loop (a reset: nothing from before it is reused)."""
        with self._lock:
            gone = [n for n, e in self._index.items() if namespace in (None, e.namespace)]
            return [self._index.pop(name).path for name in gone]

    def clear(self) -> int:
        """Delete every entry file of every model under ``root``; how many were deleted."""
        deleted = 0
        for path in _entry_files(self.root):
            try:
                path.unlink()
                deleted += 1
            except OSError:
                pass
        with self._lock:
            self._index.clear()
        return deleted

    # ------------------------------------------------------------------ budget

    def _enforce_budget(self, keep: Path | None = None) -> int:
        """Delete least recently used files (any fingerprint) until the directory fits."""
        files = []
        for path in _entry_files(self.root):
            try:
                stat = path.stat()
            except OSError:
                continue
            files.append((stat.st_mtime, path, stat.st_size))
        total = sum(size for _, _, size in files)
        evicted = 0
        for _, path, size in sorted(files, key=lambda f: (f[0], f[1] != keep)):
            if total <= self.budget_bytes:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except OSError:
                continue
            total -= size
            evicted += 1
            self._forget(path.name)
        self.counters["disk_evictions"] += evicted
        return evicted

    def _forget(self, name: str) -> None:
        with self._lock:
            self._index.pop(name, None)

    def _drop_file(self, path: Path, reason: str) -> None:
        log.warning("prefix cache: dropped %s (%s); it will be recomputed", path, reason)
        self.counters[reason] += 1
        self.counters["disk_dropped"] += 1
        self._forget(path.name)
        with contextlib.suppress(OSError):
            path.unlink()

    def gauges(self) -> dict[str, int]:
        with self._lock:
            return {
                "disk_entries": len(self._index),
                "disk_bytes": sum(e.size for e in self._index.values()),
                "disk_budget_bytes": self.budget_bytes,
            }


def usable(
    tokens: tuple[int, ...],
    trimmable: bool,
    points: tuple[int, ...],
    prompt: tuple[int, ...],
    limit: int,
) -> int:
    """How many tokens of ``prompt`` (at most ``limit``) an entry of ``tokens`` restores: any
    common prefix of a trimmable one, else all of it or one of its ``points``."""
    if trimmable:
        return common_prefix_length(tokens, prompt, limit)
    candidates = [p for p in (*points, len(tokens)) if p <= limit]
    for point in sorted(candidates, reverse=True):
        if prompt[:point] == tokens[:point]:
            return point
    return 0


def _name(namespace: str, tokens: tuple[int, ...]) -> str:
    return entry_name(namespace, tokens)


def _entry_files(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for folder in root.iterdir() if folder.is_dir() for p in folder.glob("*" + SUFFIX)]
