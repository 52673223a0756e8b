"""What an engine reports about itself: the router's ``EngineReady``, and its statistics' gauges.

Kept apart from the core so the core reads as the mailbox and the model's life; the gauges'
meanings are listed in docs/protocols.md (``Stats``).
"""

from __future__ import annotations

from collections.abc import Iterable

from actors.engine.sequence import Sequence
from runtime.backends.contract import ModelInfo
from runtime.messages import EngineReady


def ready(epoch: int, info: ModelInfo) -> EngineReady:
    """What the router hears once the model is in."""
    return EngineReady(
        epoch=epoch,
        reuse_path=str(info.reuse),
        bytes_per_token=info.bytes_per_token,
        context_length=info.context_length,
        chat_template=info.chat_template,
        limits=info.limits,
        probe_pending=info.probe_pending,
    )


def sequence_gauges(sequences: Iterable[Sequence]) -> dict[str, int]:
    """The live sequences, and what they hold for snapshots."""
    live = list(sequences)
    return {
        "sequences": len(live),
        "pending_snapshots": sum(len(s.snapshots) for s in live),
        # Of live sequences' granted reservations, what is held for snapshots (taken, or room).
        "sequence_snapshot_bytes": sum(
            s.snapshot_room + sum(taken.nbytes for taken in s.snapshots) for s in live if s.reserved
        ),
    }


def capability_gauges(info: ModelInfo | None) -> dict[str, int]:
    """The verdicts the model runs by: ``capability_<name>``, 1 on, 0 off (the offs' whys are
    in the statistics' limits)."""
    return {f"capability_{v.capability}": int(v.on) for v in (info.capabilities if info else ())}
