"""What a newly tokenized sequence does to the engine's other sequences: a plan, as data.

Once it has its tokens, a prewarm *follows* (``Join``) a live identical prewarm; in its own session
a newcomer *adopts* (``Adopt``) the first older computing prewarm whose prefill target its own
extends, and *supersedes* (``Supersede``) the other older prewarms (and, with ``supersede`` set,
older generates). Anonymous requests supersede nothing and are superseded by nothing;
``reuse_prefix=False`` adopts nothing. ``plan_supersede`` decides and admission (admission.py)
carries the plan out, so the plan alone is property-tested (property_tests/test_supersede_plan.py).

Every rule and its exceptions: docs/protocols.md, "Prewarm supersede / adopt / follow".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from runtime.messages import RequestKind


@dataclass(frozen=True)
class Join:
    """The new prewarm follows this identical one: it ends when its leader does."""

    leader: Sequence


@dataclass(frozen=True)
class Adopt:
    """The newcomer takes over this prewarm: its state, lease, snapshots and in-flight job."""

    prewarm: Sequence


@dataclass(frozen=True)
class Supersede:
    """This older sequence of the newcomer's session is aborted (reason ``"superseded"``)."""

    older: Sequence


@dataclass(frozen=True)
class SupersedePlan:
    """What a newcomer does to the other sequences: a ``Join`` first if it follows one, then its
    ``Adopt`` and ``Supersede`` steps in the sequences' order."""

    steps: tuple[Join | Adopt | Supersede, ...] = ()

    @property
    def joined(self) -> Sequence | None:
        return next((step.leader for step in self.steps if isinstance(step, Join)), None)

    @property
    def adopted(self) -> Sequence | None:
        return next((step.prewarm for step in self.steps if isinstance(step, Adopt)), None)

    @property
    def superseded(self) -> tuple[Sequence, ...]:
        return tuple(step.older for step in self.steps if isinstance(step, Supersede))


def plan_supersede(newcomer: Sequence, others: Iterable[Sequence]) -> SupersedePlan:
    """What ``newcomer`` (a generate or a prewarm, its prompt tokenized) does to ``others``.

    Only live (not aborted, not ended) sequences are touched; see the module docstring.
    """
    assert newcomer.tokens is not None
    live = [s for s in others if s is not newcomer and _live(s)]
    leader = identical_leader(newcomer, live) if newcomer.kind is RequestKind.PREWARM else None
    # Only older work: a request sent after the newcomer is newer news, even if tokenized first.
    # A session is named within its namespace: one salt's (or API key's) "editor" is not
    # another's, so a name never hands state across namespaces or cuts another's work short.
    session = [
        s
        for s in live
        if s.session == newcomer.session
        and s.namespace == newcomer.namespace
        and s.sequence_id < newcomer.sequence_id
    ]
    adopted = None
    # Not following, not adopting already, and allowed to restore state it did not compute.
    if leader is None and newcomer.resume_phase is None and newcomer.reuse_prefix:
        adopted = next(
            (
                s
                for s in session
                if s.kind is RequestKind.PREWARM
                and s.phase in COMPUTE_PHASES
                and _extends(newcomer, s)
            ),
            None,
        )
    steps: list[Join | Adopt | Supersede] = [] if leader is None else [Join(leader)]
    for other in session:
        if other is adopted:
            steps.append(Adopt(other))
        elif other.leader is not None and other.leader is adopted:
            continue  # ends with the leader it follows
        elif newcomer.anonymous or other.anonymous:
            continue  # nobody can tell whose work it is: never cut short
        elif other.kind is RequestKind.GENERATE:
            if newcomer.supersede:
                steps.append(Supersede(other))
        elif newcomer.kind is RequestKind.GENERATE or other.tokens != newcomer.tokens:
            steps.append(Supersede(other))
    return SupersedePlan(tuple(steps))


def identical_leader(prewarm: Sequence, others: Iterable[Sequence]) -> Sequence | None:
    """The live prewarm that computes exactly ``prewarm``'s tokens in its namespace (any session),
    if there is one: a leader, never one that itself follows."""
    for other in others:
        if (
            other is not prewarm
            and other.kind is RequestKind.PREWARM
            and other.leader is None
            and _live(other)
            and other.namespace == prewarm.namespace
            and other.tokens is not None
            and other.tokens == prewarm.tokens
        ):
            return other
    return None


def _live(seq: Sequence) -> bool:
    return not seq.abort.is_set() and seq.phase is not Phase.DONE


def _extends(newcomer: Sequence, prewarm: Sequence) -> bool:
    """Whether the prewarm's prefill target is a prefix of what ``newcomer`` will prefill (so
    whatever state the prewarm holds is a state of the newcomer's prompt)."""
    assert newcomer.tokens is not None
    if not prewarm.tokens:
        return False
    target = prewarm.tokens[: prewarm.prefill_target]
    mine = newcomer.tokens[: newcomer.prefill_target]
    return mine[: len(target)] == target and len(target) <= len(mine)
