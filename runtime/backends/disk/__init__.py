"""The disk tier of the prefix cache: entries the KV budget evicts, kept in files that outlive the
process (docs/design.md, "The disk tier").

``host``: a state as host arrays (what a backend exports and imports); ``entry_file``: one entry's
file (safetensors arrays, a msgspec header, a checksum, written atomically); ``store``: a
directory of them for one model fingerprint (index, LRU, byte budget); ``config``: the options.
Nothing here touches a model: the engine hands states over as ``HostState`` and gets them back.
"""

from __future__ import annotations

from runtime.backends.disk.config import DiskCacheConfig, default_cache_dir
from runtime.backends.disk.entry_file import DiskHeader, EntryInvalid, LoadAborted
from runtime.backends.disk.host import HostState, Persistent, persistent
from runtime.backends.disk.store import DiskMatch, DiskStore, WriteOutcome

__all__ = [
    "DiskCacheConfig",
    "DiskHeader",
    "DiskMatch",
    "DiskStore",
    "EntryInvalid",
    "HostState",
    "LoadAborted",
    "Persistent",
    "WriteOutcome",
    "default_cache_dir",
    "persistent",
]
