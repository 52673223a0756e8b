"""A sequence's lifecycle as a table: its phases and the legal moves between them.

Every phase change of a sequence goes through ``Sequence.move`` (sequence.py), which checks the
move against ``LEGAL_MOVES`` and raises ``IllegalMove`` on any other: an engine bug, which the
supervisor turns into a restart (``EngineCore.crashed``). The runtime state machine
(property_tests/test_runtime_machine.py) checks every move it sees against this table. The
diagram, and who makes each move, are in docs/design.md ("A sequence's lifecycle").
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Phase(enum.Enum):
    TOKENIZING = enum.auto()  # waiting for the compute thread to tokenize the prompt
    WAITING = enum.auto()  # at the admission gate: the engine runs its most sequences
    FOLLOWING = enum.auto()  # a prewarm waiting for an identical one (its leader) to end
    RESERVING = enum.auto()  # waiting for the KV keeper
    LOOKING_UP = enum.auto()  # waiting for the prefix-cache manager
    LOADING = enum.auto()  # waiting for the disk tier's I/O thread to read an entry back
    RESTORING = enum.auto()  # compute: copy (and trim) a cached state, or make an empty one
    PREFILLING = enum.auto()  # compute: prompt chunks
    DECODING = enum.auto()  # compute: one token per step
    DONE = enum.auto()


COMPUTE_PHASES = frozenset({Phase.RESTORING, Phase.PREFILLING, Phase.DECODING})

P = Phase  # short, for the table
# Any live phase may end (DONE): finished, cancelled or failed. An adopting generate resumes from
# RESERVING where the prewarm it adopted was (RESTORING or PREFILLING, supersede.py).
LEGAL_MOVES: Mapping[Phase, frozenset[Phase]] = {
    P.TOKENIZING: frozenset({P.WAITING, P.FOLLOWING, P.RESERVING, P.DONE}),
    P.WAITING: frozenset({P.RESERVING, P.DONE}),
    P.FOLLOWING: frozenset({P.WAITING, P.RESERVING, P.DONE}),
    P.RESERVING: frozenset({P.LOOKING_UP, P.RESTORING, P.PREFILLING, P.DONE}),
    P.LOOKING_UP: frozenset({P.LOADING, P.RESTORING, P.DONE}),
    P.LOADING: frozenset({P.RESTORING, P.DONE}),
    P.RESTORING: frozenset({P.PREFILLING, P.DONE}),
    P.PREFILLING: frozenset({P.DECODING, P.DONE}),
    P.DECODING: frozenset({P.DONE}),
    P.DONE: frozenset(),
}


class IllegalMove(RuntimeError):
    """Raised by ``Sequence.move`` for a move ``LEGAL_MOVES`` does not list: a bug in the engine
    (never a user's doing); the engine crashes and is restarted with its model reloaded."""

    def __init__(self, sequence_id: int, source: Phase, target: Phase) -> None:
        super().__init__(
            f"sequence {sequence_id}: no legal move from {source.name} to {target.name} "
            "(actors/engine/lifecycle.py LEGAL_MOVES)"
        )
        self.source = source
        self.target = target


def check_move(sequence_id: int, source: Phase, target: Phase) -> None:
    """Raise ``IllegalMove`` unless ``source`` -> ``target`` is in ``LEGAL_MOVES``."""
    if target not in LEGAL_MOVES[source]:
        raise IllegalMove(sequence_id, source, target)
