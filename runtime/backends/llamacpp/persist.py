"""llama.cpp states as host arrays for the disk tier (``runtime.backends.disk.host.Persistent``).

A state is written as the bytes ``llama_state_seq_get_data`` gives for its seq_id (every cache's
cells), the very bytes a state moved to host memory holds (``seqs.SeqPool``); a point's snapshot
as its partial bytes (``PARTIAL_ONLY``). Importing runs no llama.cpp call, since it may run on the
I/O thread and a context is the compute thread's alone: the state comes back *spilled*, and its
first use on the compute thread puts the bytes into a free seq_id. The fingerprint names
everything that changes whether saved bytes can be put back: the GGUF file, llama-cpp-python's
and llama.cpp's state versions, ``exact_reuse`` (the V cache layout) and the context per sequence.

The disk tier on llama.cpp: docs/design.md, "The disk tier".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

import numpy as np

from runtime.backends.contract import SequenceState, Snapshot
from runtime.backends.disk.host import HostState
from runtime.backends.llamacpp.binding import Context, import_llama_cpp
from runtime.backends.llamacpp.seqs import LlamaSnapshot, LlamaState, own_state

LAYOUT_VERSION = 1
STATE = "state"


def fingerprint(
    gguf: Path, sha256: str | None, exact_reuse: bool, state_version: int, cells: int
) -> str:
    """A hex digest of everything an exported state depends on (see the module docstring)."""
    resolved = gguf.resolve()
    stat = resolved.stat()
    text = (
        f"llamacpp|layout {LAYOUT_VERSION}|llama-cpp-python {version('llama_cpp_python')}"
        f"|state {state_version}|exact_reuse {exact_reuse}|cells {cells}|{resolved}"
        f"|{stat.st_size}|{stat.st_mtime_ns}|sha256 {sha256}"
    )
    return hashlib.sha256(text.encode()).hexdigest()


def export_state(
    context: Context, state: SequenceState, points: Mapping[int, Snapshot]
) -> HostState:
    """``state``'s cells and ``points``' partial cells as byte arrays (compute thread): a spilled
    state's own bytes, or one ``get_seq_data`` of a resident one."""
    own = own_state(state)
    if own.seq is not None:
        data = context.get_seq_data(own.seq)
    elif own.spilled is not None:
        data = own.spilled
    else:
        raise ValueError("an empty llama.cpp state has nothing to write")
    arrays = {STATE: np.frombuffer(data, dtype=np.uint8)}
    for length, snapshot in points.items():
        if not isinstance(snapshot, LlamaSnapshot) or snapshot.n_tokens != length:
            raise TypeError(f"not a llama.cpp snapshot of {length} tokens: {snapshot!r}")
        if snapshot.data:  # safetensors holds no empty arrays: an absent one means empty
            arrays[f"p{length}"] = np.frombuffer(snapshot.data, dtype=np.uint8)
    layout = {"version": LAYOUT_VERSION, "high_water": max(own.high_water, own.n_tokens)}
    return HostState(own.n_tokens, json.dumps(layout), arrays, tuple(sorted(points)))


def import_state(host: HostState) -> tuple[LlamaState, dict[int, LlamaSnapshot]]:
    """A spilled state and the snapshots ``host`` holds; raises ``ValueError`` on a layout that
    is not this version's."""
    try:
        layout = json.loads(host.layout)
        if layout.get("version") != LAYOUT_VERSION:
            raise ValueError(f"layout version {layout.get('version')!r}")
        high_water = int(layout["high_water"])
        data = _bytes(host.arrays[STATE])
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
        raise ValueError(f"an exported state that does not fit: {exc!r}") from exc
    if not data or host.length <= 0 or high_water < host.length:
        raise ValueError("an exported llama.cpp state with no cells or a wrong length")
    if any(not 0 < p <= host.length for p in host.points):
        raise ValueError("an exported llama.cpp state with points outside it")
    state = LlamaState()
    state.spilled = data
    state.n_tokens = host.length
    state.high_water = high_water
    snapshots = {
        p: LlamaSnapshot(_bytes(host.arrays[f"p{p}"]) if f"p{p}" in host.arrays else b"", p)
        for p in host.points
    }
    return state, snapshots


def _bytes(array: np.ndarray) -> bytes:
    if array.dtype != np.uint8 or array.ndim != 1:
        raise ValueError(f"a llama.cpp state array of {array.dtype} {array.shape}")
    return array.tobytes()


class Persisting:
    """``Persistent`` for ``LlamaCppBackend``: what it knows of its file and context."""

    path: Path
    _identity: tuple[str | None, bool]  # the file's pinned sha256, exact_reuse
    _context: Context

    def fingerprint(self) -> str:
        state_version = int(import_llama_cpp().LLAMA_STATE_SEQ_VERSION)
        return fingerprint(self.path, *self._identity, state_version, self._context.n_ctx_seq)

    def export_state(self, state: SequenceState, points: Mapping[int, Snapshot]) -> HostState:
        return export_state(self._context, state, points)

    def import_state(self, host: HostState) -> tuple[LlamaState, dict[int, LlamaSnapshot]]:
        return import_state(host)
