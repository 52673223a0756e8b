"""A sequence state as host arrays: what a backend exports to the disk tier and imports back.

A backend that can persist states implements ``Persistent`` beside the ``Backend`` contract.
``export_state`` runs on the compute thread and is cheap: it makes sure the arrays are computed
and hands out host views of them (no copy), so a decode step waits for nothing. ``import_state``
may run on any thread: it makes arrays from host memory and runs no model. ``fingerprint`` names
what a state depends on (weights, dtype, KV quantisation, layout version): a state exported under
one fingerprint is only ever imported under the same one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from runtime.backends.contract import SequenceState, Snapshot


@dataclass(frozen=True)
class HostState:
    """A state of ``length`` tokens and its points' snapshots, as named host arrays.

    ``layout`` is the backend's own description of how the arrays make the state back (JSON
    text, opaque to the disk tier); ``points`` the token counts it also restores at.
    """

    length: int
    layout: str
    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    points: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


@runtime_checkable
class Persistent(Protocol):
    """What a backend offers the disk tier (optional: a backend without it never spills)."""

    def fingerprint(self) -> str:
        """A stable name of everything a state's arrays depend on (hex digest)."""
        ...

    def export_state(self, state: SequenceState, points: Mapping[int, Snapshot]) -> HostState:
        """``state`` and the snapshots at ``points`` as host views (compute thread, no copy)."""
        ...

    def import_state(self, host: HostState) -> tuple[SequenceState, dict[int, Snapshot]]:
        """The state and point snapshots ``host`` holds; raises ``ValueError`` if its layout
        does not fit this model (any thread)."""
        ...


def persistent(backend: object) -> Persistent | None:
    """``backend`` as a ``Persistent``, or None where it cannot persist states."""
    return backend if isinstance(backend, Persistent) else None
