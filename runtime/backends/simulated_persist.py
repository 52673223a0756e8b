"""The simulated backend's states as host arrays, so the disk tier runs on the simulator too.

A state is its tokens and the rolling hash after each; a snapshot is its length and hash. Restored
states carry no logits (as on MLX): the engine must prefill at least one token after a restore,
and sampling without one is caught (``SimulatedState.has_logits``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import numpy as np

from runtime.backends.contract import SequenceState, Snapshot
from runtime.backends.disk.host import HostState
from runtime.backends.options import SimulatedModelOptions


def fingerprint(options: SimulatedModelOptions) -> str:
    """What a simulated state depends on: its hash is the same for every simulated model, its
    snapshot sizes and trimmability are the options'."""
    text = f"simulated|1|{options.trimmable}|{options.fixed_state_bytes}"
    return hashlib.sha256(text.encode()).hexdigest()


def export_state(state: SequenceState, points: Mapping[int, Snapshot]) -> HostState:
    from runtime.backends.simulated_tokens import SimulatedSnapshot, SimulatedState

    assert isinstance(state, SimulatedState)
    kept = {}
    for length, snapshot in points.items():
        assert isinstance(snapshot, SimulatedSnapshot)
        kept[str(length)] = [snapshot.prefix_hash, snapshot.nbytes]
    arrays = {
        "tokens": np.asarray(state.tokens, dtype=np.int64),
        "hashes": np.asarray(state.hashes, dtype=np.uint64),
    }
    return HostState(state.length, json.dumps({"points": kept}), arrays, tuple(sorted(points)))


def import_state(host: HostState) -> tuple[SequenceState, dict[int, Snapshot]]:
    from runtime.backends.simulated_tokens import SimulatedSnapshot, SimulatedState

    try:
        tokens = [int(t) for t in host.arrays["tokens"]]
        hashes = [int(h) for h in host.arrays["hashes"]]
        kept = json.loads(host.layout)["points"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a simulated state: {exc!r}") from exc
    if len(tokens) != host.length or len(hashes) != host.length:
        raise ValueError("a simulated state whose arrays do not match its length")
    state = SimulatedState(tokens, hashes)
    state.has_logits = False
    points: dict[int, Snapshot] = {
        int(length): SimulatedSnapshot(int(length), int(h), int(n))
        for length, (h, n) in kept.items()
    }
    return state, points
