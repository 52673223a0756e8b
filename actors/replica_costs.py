"""Which replica a request's first token comes soonest from: the exact routing decision.

A replica's cost is an estimate of the request's time to first token there, in prefill tokens:
the work queued ahead of it (its other requests' unfinished prefills, a decode step if any
decodes), plus the prompt tokens it would prefill there (less the longest prefix that replica
holds, from the prefix manager's exact lookup), plus ``move_tokens`` to move. The cheapest wins:
the longest prefix wins unless its queue costs more than the prefill it saves. A tie (a prompt
held nowhere, idle replicas) goes to the replica holding the least cached state, so new sessions
spread. Nothing is timed or guessed from text. Weights: ``ClusterConfig`` (docs/cluster.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RoutingCosts:
    """The estimate's weights, in prefill tokens (see module docstring)."""

    # The decode step a replica with requests decoding runs before a newcomer's prefill:
    # SmolLM2 on one CPU thread decodes a token in the time it prefills ~20 (docs/cluster.md).
    decode_step_tokens: int = 20
    # Moving a request after its first replica looked it up: an abort and a new admission, the
    # crossings of one request on Ray (~6 ms, docs/cluster.md): about a token's prefill, x4.
    move_tokens: int = 4


@dataclass(frozen=True)
class Queued:
    """One live request on a replica, as the estimate sees it."""

    uncached: int | None  # prompt tokens it still prefills there (None: not looked up yet)
    decoding: bool  # its first token came: it holds a decode step, no prefill


def queue_tokens(queued: Iterable[Queued], costs: RoutingCosts) -> int:
    """The work ahead of a new request on a replica: every prefill not finished (an engine runs
    them one at a time), whole (one under way counts all of it; one not looked up yet counts
    nothing: its prompt is not known in tokens yet), and one decode step if any request decodes
    there (a newcomer's prompt goes ahead of the decode batch, which steps for all its rows at
    once: actors/engine/turns.py)."""
    prefills = sum(q.uncached or 0 for q in queued if not q.decoding)
    decoding = any(q.decoding for q in queued)
    return prefills + (costs.decode_step_tokens if decoding else 0)


def replica_cost(queue: int, prompt: int, matched: int, moving: bool, costs: RoutingCosts) -> int:
    """The estimated time to first token, in prefill tokens, of a ``prompt``-token request on a
    replica with ``queue`` ahead of it that holds ``matched`` of its tokens."""
    return queue + max(prompt - matched, 0) + (costs.move_tokens if moving else 0)


def cheapest(
    here: str,
    prompt: int,
    matched: Mapping[str, int],
    queues: Mapping[str, int],
    resident: Mapping[str, int],
    costs: RoutingCosts,
) -> str:
    """The replica (of ``queues``' keys, ``here`` among them) with the lowest cost; on a tie,
    ``here`` (no move), then the one with the least ``resident`` cached bytes, then by name."""

    def rank(replica: str) -> tuple[int, bool, int, str]:
        moving = replica != here
        cost = replica_cost(queues[replica], prompt, matched.get(replica, 0), moving, costs)
        return cost, moving, resident.get(replica, 0), replica

    return min(queues, key=rank)
