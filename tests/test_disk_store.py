"""The disk tier's files and directory (runtime/backends/disk/): what is written is read back
exactly, and every bad file (truncated, corrupt, foreign, another model's, another prompt's) is
refused, deleted and counted; the budget evicts least recently used files first; a full disk is a
counted failure; two processes on one directory never read half a file. No model runs here: the
states are plain host arrays."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from runtime.backends.disk import DiskStore, EntryInvalid, HostState, LoadAborted
from runtime.backends.disk.entry_file import entry_name, read_entry

FINGERPRINT = "a" * 64
NS = "default"


def host(tokens: tuple[int, ...], fill: float = 1.0, size: int = 1000) -> HostState:
    arrays = {
        "s0.0": np.full((1, 2, len(tokens), 4), fill, dtype=np.float32),
        "s0.1": np.arange(size, dtype=np.uint16),
    }
    return HostState(len(tokens), json.dumps({"fill": fill}), arrays, ())


def store(root: Path, budget: int = 1 << 30, fingerprint: str = FINGERPRINT) -> DiskStore:
    opened = DiskStore(root, fingerprint, budget)
    opened.scan()
    return opened


def written(root: Path, tokens: tuple[int, ...], **kwargs: float) -> Path:
    outcome = store(root).write(NS, tokens, True, host(tokens, **kwargs))  # type: ignore[arg-type]
    assert outcome.written > 0
    return root / FINGERPRINT[:32] / entry_name(NS, tokens)


def test_an_entry_reads_back_exactly_and_serves_any_shared_prefix(tmp_path: Path) -> None:
    tokens = (5, 6, 7, 8, 9)
    written(tmp_path, tokens, fill=2.5)
    reopened = store(tmp_path)  # a new process finds it by its header
    match = reopened.best(NS, (5, 6, 7, 1, 1))
    assert match is not None
    assert (match.matched, match.tokens, match.trimmable) == (3, tokens, True)
    assert reopened.best("other", (5, 6, 7, 1)) is None  # namespaces never share
    assert reopened.best(NS, (5, 6, 7, 8, 9))
    assert reopened.best(NS, (5, 6, 7, 8, 9)).matched == 4  # type: ignore[union-attr]
    back = reopened.read(match, NS)
    assert back.layout == json.dumps({"fill": 2.5})
    for name, array in host(tokens, fill=2.5).arrays.items():
        np.testing.assert_array_equal(back.arrays[name], array)


def test_a_checkpoint_entry_is_served_only_whole_or_at_its_points(tmp_path: Path) -> None:
    tokens = tuple(range(10, 30))
    state = HostState(20, "{}", {"x": np.ones(3, np.float32)}, points=(8, 16))
    assert store(tmp_path).write(NS, tokens, False, state).written
    reopened = store(tmp_path)
    assert reopened.best(NS, (*tokens, 99)).matched == 20  # type: ignore[union-attr]
    assert reopened.best(NS, (*tokens[:17], 99)).matched == 16  # type: ignore[union-attr]
    assert reopened.best(NS, (*tokens[:12], 99)).matched == 8  # type: ignore[union-attr]
    assert reopened.best(NS, (*tokens[:7], 99)) is None


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last array's bytes
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-50])


def _foreign(path: Path) -> None:
    save_file({"x": np.zeros(3, np.float32)}, str(path))  # a safetensors file, not an entry


def _garbage(path: Path) -> None:
    path.write_bytes(b"not a safetensors file at all")


@pytest.mark.parametrize("damage", [_flip, _truncate, _foreign, _garbage])
def test_a_damaged_file_is_refused_deleted_and_counted(tmp_path: Path, damage) -> None:  # type: ignore[no-untyped-def]
    tokens = (1, 2, 3, 4)
    path = written(tmp_path, tokens)
    opened = store(tmp_path)
    match = opened.best(NS, (1, 2, 3, 4, 5))
    assert match is not None
    damage(path)
    with pytest.raises(EntryInvalid) as refused:
        opened.read(match, NS)
    assert refused.value.reason in ("disk_corrupt", "disk_foreign_format")
    assert not path.exists()
    assert opened.counters["disk_dropped"] == 1
    assert opened.best(NS, (1, 2, 3, 4, 5)) is None


def test_a_scan_drops_files_it_cannot_use(tmp_path: Path) -> None:
    good = written(tmp_path, (1, 2, 3))
    bad = written(tmp_path, (4, 5, 6))
    _truncate(bad)
    folder = good.parent
    (folder / "stray.safetensors").write_bytes(b"junk")
    stale = folder / ".x.safetensors.1.abcd.tmp"
    stale.write_bytes(b"half")
    os.utime(stale, (0, 0))  # a writer that died long ago
    opened = store(tmp_path)
    assert opened.gauges()["disk_entries"] == 1
    assert opened.counters["disk_dropped"] == 2
    assert sorted(p.name for p in folder.iterdir()) == [good.name]


def test_another_models_file_is_never_used(tmp_path: Path) -> None:
    path = written(tmp_path, (1, 2, 3))
    other = store(tmp_path, fingerprint="b" * 64)
    other.folder.mkdir(parents=True)
    moved = other.folder / path.name
    path.rename(moved)  # copied into the other model's folder: its header still says who made it
    other.scan()
    assert other.best(NS, (1, 2, 3, 4)) is None
    assert other.counters["disk_wrong_model"] == 1
    assert not moved.exists()


def test_a_file_for_other_tokens_is_refused(tmp_path: Path) -> None:
    written(tmp_path, (1, 2, 3))
    opened = store(tmp_path)
    match = opened.best(NS, (1, 2, 3, 4))
    assert match is not None
    other = opened.folder / entry_name(NS, (1, 2, 3))
    with pytest.raises(EntryInvalid) as refused:
        read_entry(other, FINGERPRINT, NS, (1, 2, 9))
    assert refused.value.reason == "disk_foreign_entry"


def test_a_read_stops_between_arrays_once_asked(tmp_path: Path) -> None:
    written(tmp_path, (1, 2, 3))
    opened = store(tmp_path)
    match = opened.best(NS, (1, 2, 3, 4))
    assert match is not None
    stop = threading.Event()
    stop.set()
    with pytest.raises(LoadAborted):
        opened.read(match, NS, stop)
    assert opened.best(NS, (1, 2, 3, 4)) is not None  # an abort is no fault of the file


def test_the_budget_evicts_the_least_recently_used_files(tmp_path: Path) -> None:
    size = written(tmp_path, (1,), size=4000).stat().st_size
    budget = int(size * 2.5)  # room for two
    opened = store(tmp_path, budget=budget)
    assert opened.write(NS, (2,), True, host((2,), size=4000)).written
    first, second = (opened.folder / entry_name(NS, (t,)) for t in (1, 2))
    os.utime(first, ns=(1_000_000_000, 1_000_000_000))
    os.utime(second, ns=(2_000_000_000, 2_000_000_000))
    opened.read(opened.best(NS, (1, 5)), NS)  # type: ignore[arg-type]  # now the most recent
    outcome = opened.write(NS, (3,), True, host((3,), size=4000))
    assert outcome.evicted == 1
    assert first.exists()
    assert not second.exists()
    assert opened.best(NS, (2, 5)) is None
    assert opened.gauges()["disk_bytes"] <= budget


def test_an_entry_larger_than_the_budget_is_not_written(tmp_path: Path) -> None:
    opened = store(tmp_path, budget=100)
    outcome = opened.write(NS, (1,), True, host((1,)))
    assert outcome.failure == "disk_too_large"
    assert not list(opened.root.rglob("*.safetensors"))


def test_a_full_disk_is_a_counted_failure_that_leaves_nothing_behind(tmp_path: Path) -> None:
    opened = store(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
    try:
        outcome = opened.write(NS, (1, 2), True, host((1, 2), size=5000))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert outcome.failure == "disk_write_failed"
    assert opened.counters["disk_write_failed"] == 1
    assert list(opened.folder.iterdir()) == []  # no temporary left
    assert opened.write(NS, (1, 2), True, host((1, 2), size=5000)).written  # room again: kept


_WRITER = """
import sys, json, numpy as np
from pathlib import Path
from runtime.backends.disk import DiskStore, HostState
store = DiskStore(Path(sys.argv[1]), "a" * 64, 1 << 30)
for i in range(int(sys.argv[2])):
    fill = float(i % 2)
    arrays = {"s0.0": np.full((1, 2, 3, 50000), fill, np.float32)}
    store.write("default", (1, 2, 3), True, HostState(3, json.dumps({"fill": fill}), arrays))
print("done")
"""


def test_two_processes_on_one_directory_never_read_half_a_file(tmp_path: Path) -> None:
    """Another process rewrites the same entry (two contents, each whole) while this one reads it
    again and again: every read passes its checksum and is one of the two."""
    written(tmp_path, (1, 2, 3))
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), "60"],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.PIPE,
    )
    reads = 0
    try:
        while writer.poll() is None or reads < 5:
            opened = store(tmp_path)
            match = opened.best(NS, (1, 2, 3, 4))
            assert match is not None
            back = opened.read(match, NS)  # EntryInvalid here would be a half-written file
            fill = json.loads(back.layout)["fill"]
            assert np.all(back.arrays["s0.0"] == np.float32(fill))
            reads += 1
    finally:
        out, _ = writer.communicate(timeout=120)
    assert writer.returncode == 0
    assert b"done" in out
    assert reads >= 5
