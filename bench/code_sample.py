"""Python source for the keystroke scenario: a file a person is writing, in an editor that asks
for a completion at every keystroke. Ordinary code (imports, a dataclass, docstrings, a class with
methods) so the real models see the kind of text editor completion sees."""

CODE_SAMPLE = '''"""A small cache for HTTP responses, keyed by URL, with a size limit and expiry."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class Entry:
    """One cached response body with the time it was stored and how long it stays fresh."""

    body: bytes
    stored_at: float
    ttl_s: float
    hits: int = 0

    def expired(self, now: float) -> bool:
        return now - self.stored_at > self.ttl_s


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    expirations: int = 0
    sizes: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class ResponseCache:
    """Least-recently-used cache of response bodies, bounded by the total size in bytes.

    Thread-safe: every public method takes the lock. Entries older than their TTL are dropped
    when they are read, and the oldest entries are evicted when a new body does not fit.
    """

    def __init__(
        self,
        max_bytes: int = 64 * 1024 * 1024,
        default_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        self._default_ttl_s = default_ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()
        self.stats = Stats()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, url: object) -> bool:
        with self._lock:
            return url in self._entries

    def get(self, url: str) -> bytes | None:
        """The cached body for ``url``, or None if it is missing or expired."""
        with self._lock:
            entry = self._entries.get(url)
            if entry is None:
                self.stats.misses += 1
                return None
            if entry.expired(self._clock()):
                self._remove(url)
                self.stats.expirations += 1
                self.stats.misses += 1
                return None
            self._entries.move_to_end(url)
            entry.hits += 1
            self.stats.hits += 1
            return entry.body

    def put(self, url: str, body: bytes, ttl_s: float | None = None) -> None:
        """Store ``body`` for ``url``, evicting the least recently used entries to make room."""
        if len(body) > self._max_bytes:
            return
        with self._lock:
            if url in self._entries:
                self._remove(url)
            while self._size + len(body) > self._max_bytes:
                oldest = next(iter(self._entries))
                self._remove(oldest)
                self.stats.evictions += 1
            ttl = self._default_ttl_s if ttl_s is None else ttl_s
            self._entries[url] = Entry(body, self._clock(), ttl)
            self._size += len(body)
            self.stats.sizes.append(len(body))

    def invalidate(self, prefix: str) -> int:
        """Drop every entry whose URL starts with ``prefix``; returns how many were dropped."""
        with self._lock:
            doomed = [url for url in self._entries if url.startswith(prefix)]
            for url in doomed:
                self._remove(url)
            return len(doomed)

    def items(self) -> Iterator[tuple[str, bytes]]:
        with self._lock:
            snapshot = [(url, entry.body) for url, entry in self._entries.items()]
        yield from snapshot

    def _remove(self, url: str) -> None:
        entry = self._entries.pop(url)
        self._size -= len(entry.body)

    def expire(self) -> int:
        """Drop every expired entry now; returns how many were dropped."""
        with self._lock:
            now = self._clock()
            stale = [url for url, entry in self._entries.items() if entry.expired(now)]
            for url in stale:
                self._remove(url)
            self.stats.expirations += len(stale)
            return len(stale)

    def resize(self, max_bytes: int) -> None:
        """Change the size limit, evicting the least recently used entries if it shrank."""
        with self._lock:
            self._max_bytes = max_bytes
            while self._size > self._max_bytes and self._entries:
                oldest = next(iter(self._entries))
                self._remove(oldest)
                self.stats.evictions += 1
'''
