"""Which replica a request's first token comes soonest from: the exact routing decision.

A replica's cost for a request is an estimate of its time to first token, in prefill-token units:
the work queued ahead of it there (the prompt tokens its other requests still have to prefill,
and a decode step if any is decoding) plus the prompt tokens this request would
prefill there (its prompt less the longest prefix that replica holds, from the prefix manager's
exact lookup), plus ``move_tokens`` for a replica it would have to move to. The cheapest wins, so
the replica holding the longest prefix wins unless its queue costs more than the prefill it
saves: what "not overloaded" means. A tie (a new session's prompt, held nowhere, on idle
replicas) goes to the replica holding the least cached state, so co-active sessions spread.
Nothing here is timed or approximated from text: the token counts are the engines' and the
prefix manager's. The weights are ``ClusterConfig``'s (docs/cluster.md, "Routing across
replicas").
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
