"""The supersede / adopt / join plan of a newcomer, checked without an engine (docs/protocols.md).

``plan_supersede`` is a pure function of the newcomer (a generate or a prewarm, just tokenized) and
the engine's other sequences. Sequences are drawn over three sessions (two of them in one
namespace), every phase, aborted or not, anonymous or not, some following an earlier one, some
admitted after the newcomer, with prompts from a two-token alphabet so that one prompt often
extends or equals another. The rules, as protocols.md states them:

- a prewarm follows (``Join``) the first live identical prewarm of its namespace that leads (any
  session); a generate never follows;
- only live (not aborted, not ended), older (admitted before it) sequences of the newcomer's
  session are adopted or superseded, each at most once, in the table's order;
- at most one prewarm is adopted, and only by a newcomer that follows none and adopted none yet
  (and, a generate, may reuse prefixes: ``reuse_prefix``): the first computing one (restoring,
  prefilling, decoding) whose prefill target its own extends;
- the followers of the adopted prewarm are left to end with it; nothing anonymous, and nothing of
  an anonymous newcomer, is superseded; an older generate is superseded exactly when the newcomer
  is a generate with ``supersede`` set; a prewarm identical to a prewarm newcomer is left (the same
  work); every other live prewarm of the session is superseded;
- so a named newcomer leaves no other older named prewarm of its session computing but its
  leader;
- making the plan changes nothing.

Settings come from the active Hypothesis profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given
from hypothesis import strategies as st

from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from actors.engine.supersede import Adopt, Join, Supersede, plan_supersede
from runtime.messages import Admit, Generate, Prewarm, RequestKind, TokenIds
from runtime.testing import requests

# Session → its namespace: "m/default" and "editor" share one, so prewarms may join across them.
NAMESPACES = {"m/default": "default", "editor": "default", "m/other": "other"}
SESSIONS = tuple(NAMESPACES)


@dataclass(frozen=True)
class Drawn:
    """One sequence as drawn: its request's kind and session, its prompt, where it stands."""

    kind: RequestKind
    session: str
    tokens: TokenIds | None
    phase: Phase
    aborted: bool = False
    supersede: bool = False
    anonymous: bool = False
    reuse_prefix: bool = True  # a generate sent with False adopts nothing
    leader: int | None = None  # index of an earlier drawn sequence it follows
    newer: bool = False  # admitted after the newcomer (tokenized first all the same)


def build(sequence_id: int, drawn: Drawn) -> Sequence:
    namespace, anonymous = NAMESPACES[drawn.session], drawn.anonymous
    request: Generate | Prewarm
    if drawn.kind is RequestKind.GENERATE:
        request = requests.generate(
            f"r{sequence_id}",
            max_tokens=None,
            incarnation=sequence_id,
            prompt="text",
            namespace=namespace,
            anonymous=anonymous,
            supersede=drawn.supersede,
            reuse_prefix=drawn.reuse_prefix,
        )
    else:
        request = requests.prewarm(
            f"r{sequence_id}",
            incarnation=sequence_id,
            prompt="text",
            namespace=namespace,
            anonymous=anonymous,
        )
    admit = Admit(sequence_id=sequence_id, epoch=1, session=drawn.session, request=request)
    seq = Sequence.admitted(admit, "m")
    seq.tokens, seq.phase = drawn.tokens, drawn.phase
    if drawn.aborted:
        seq.abort.set()
    return seq


NEWCOMER_ID = 100  # sequence ids only grow: older sequences have lower ones


def build_table(drawn: list[Drawn]) -> list[Sequence]:
    table = [build(i + 1 + (NEWCOMER_ID if d.newer else 0), d) for i, d in enumerate(drawn)]
    for seq, d in zip(table, drawn, strict=True):
        if d.leader is not None and d.leader < len(table):
            seq.leader = table[d.leader]
    return table


TAILS: tuple[TokenIds, ...] = ((), (1,), (2,))
prompts = st.lists(st.integers(min_value=1, max_value=2), min_size=1, max_size=5).map(tuple)


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Drawn, list[Drawn]]:
    """A newcomer just tokenized (planned before it reserves), and the engine's other sequences."""
    new = Drawn(
        kind=draw(st.sampled_from(list(RequestKind))),
        session=draw(st.sampled_from(SESSIONS)),
        tokens=draw(prompts),
        phase=Phase.TOKENIZING,
        supersede=draw(st.booleans()),
        anonymous=draw(st.sampled_from([False, False, True])),
        reuse_prefix=draw(st.sampled_from([True, True, False])),
    )
    assert new.tokens is not None
    # Often the newcomer's prompt, cut short or whole, maybe with a token of its own.
    cut = st.integers(min_value=0, max_value=len(new.tokens))
    related = st.builds(lambda n, extra: new.tokens[:n] + extra, cut, st.sampled_from(TAILS))
    # Weighted towards what the rules are about: live prewarms of the session that compute.
    phases = st.sampled_from(sorted(COMPUTE_PHASES, key=str)) | st.sampled_from(list(Phase))
    drawn: list[Drawn] = []
    for i in range(draw(st.integers(min_value=0, max_value=6))):
        phase = draw(phases)
        tokens = draw(st.just(new.tokens) | related | prompts)
        # Past tokenization a sequence has its tokens; a tokenizing one may have been given them.
        if phase is Phase.TOKENIZING and draw(st.booleans()):
            tokens = None
        drawn.append(
            Drawn(
                kind=draw(st.sampled_from([RequestKind.PREWARM, *RequestKind])),
                session=draw(st.sampled_from([new.session, *SESSIONS])),
                tokens=tokens,
                phase=phase,
                aborted=draw(st.sampled_from([False, False, True])),
                supersede=draw(st.booleans()),
                anonymous=draw(st.sampled_from([False, False, True])),
                newer=draw(st.sampled_from([False, False, False, True])),
                # Only a prewarm waiting in FOLLOWING has a leader (as in the engine).
                leader=draw(st.none() | st.integers(min_value=0, max_value=max(i - 1, 0)))
                if phase is Phase.FOLLOWING
                else None,
            )
        )
    return new, drawn


def extends(newcomer: Sequence, prewarm: Sequence) -> bool:
    """Whether the prewarm's prefill target is a prefix of the newcomer's."""
    assert newcomer.tokens is not None
    if not prewarm.tokens:
        return False
    target = prewarm.tokens[: prewarm.prefill_target]
    mine = newcomer.tokens[: newcomer.prefill_target]
    return len(target) <= len(mine) and mine[: len(target)] == target


def live(seq: Sequence) -> bool:
    return not seq.abort.is_set() and seq.phase is not Phase.DONE


def prewarm(
    tokens: TokenIds,
    phase: Phase,
    session: str = SESSIONS[0],
    *,
    anonymous: bool = False,
    leader: int | None = None,
    newer: bool = False,
) -> Drawn:
    kind = RequestKind.PREWARM
    return Drawn(kind, session, tokens, phase, anonymous=anonymous, leader=leader, newer=newer)


TYPED = Drawn(RequestKind.GENERATE, SESSIONS[0], (1, 2, 1), Phase.TOKENIZING)
FOCUS = prewarm((1, 2, 1), Phase.TOKENIZING)  # a new prewarm
COLD = Drawn(RequestKind.GENERATE, SESSIONS[0], (1, 2, 1), Phase.TOKENIZING, reuse_prefix=False)
PREFILLING = Phase.PREFILLING


@given(scene=scenes())
# The cases each rule turns on, always run besides the drawn ones.
@example(scene=(TYPED, [prewarm((1, 2, 1, 2), Phase.DONE), prewarm((1, 2), PREFILLING)]))
@example(scene=(TYPED, [prewarm((1, 2), Phase.LOOKING_UP), prewarm((1, 2), Phase.RESTORING)]))
@example(scene=(TYPED, [prewarm((1, 2), Phase.DECODING), prewarm((1, 2, 1), PREFILLING)]))
@example(scene=(TYPED, [prewarm((2, 2), PREFILLING), prewarm((1, 2), PREFILLING)]))
@example(scene=(TYPED, [prewarm((1, 2), PREFILLING, SESSIONS[1])]))
@example(scene=(FOCUS, [prewarm((2, 2), PREFILLING), prewarm((1, 2), PREFILLING)]))  # supersede
@example(scene=(FOCUS, [prewarm((1, 2, 1), PREFILLING, "editor")]))  # join across sessions
@example(scene=(FOCUS, [prewarm((1, 2, 1), PREFILLING), prewarm((1, 2, 1), Phase.FOLLOWING)]))
@example(scene=(TYPED, [prewarm((1, 2), PREFILLING), prewarm((1, 2), Phase.FOLLOWING, leader=0)]))
@example(scene=(FOCUS, [prewarm((2,), PREFILLING, anonymous=True)]))
@example(scene=(TYPED, [prewarm((2,), Phase.RESERVING, newer=True)]))  # sent after it: left
@example(scene=(COLD, [prewarm((1, 2), PREFILLING)]))  # restores nothing: supersedes, not adopts
def test_the_plan_follows_the_supersede_adopt_and_join_rules(
    scene: tuple[Drawn, list[Drawn]],
) -> None:
    new, drawn = scene
    newcomer = build(NEWCOMER_ID, new)
    table = build_table(drawn)
    before = [(s.phase, s.abort.is_set(), s.adopted_by, s.leader) for s in table]

    plan = plan_supersede(newcomer, [newcomer, *table])

    is_prewarm = newcomer.kind is RequestKind.PREWARM
    identical = [
        s
        for s in table
        if live(s)
        and s.kind is RequestKind.PREWARM
        and s.leader is None
        and s.namespace == newcomer.namespace
        and s.tokens == newcomer.tokens
    ]
    leader = identical[0] if is_prewarm and identical else None
    assert plan.joined is leader
    assert [type(step) for step in plan.steps].count(Join) == (leader is not None)
    assert leader is None or isinstance(plan.steps[0], Join)

    session = [
        s
        for s in table
        if live(s)
        and (s.session, s.namespace) == (newcomer.session, newcomer.namespace)
        and s.sequence_id < newcomer.sequence_id
    ]
    touched = [step.prewarm if isinstance(step, Adopt) else step.older for step in plan.steps
               if not isinstance(step, Join)]  # fmt: skip
    # Only live sequences of its session, each at most once, in the table's order.
    assert [id(t) for t in touched] == [id(s) for s in session if any(s is t for t in touched)]
    adoptable = [
        s
        for s in session
        if s.kind is RequestKind.PREWARM and s.phase in COMPUTE_PHASES and extends(newcomer, s)
    ]
    reuses = newcomer.kind is RequestKind.PREWARM or new.reuse_prefix
    adopted = adoptable[0] if adoptable and leader is None and reuses else None
    assert plan.adopted is adopted
    for seq in session:
        superseded = any(seq is t for t in plan.superseded)
        follows_adopted = seq.leader is not None and seq.leader is adopted
        if seq is adopted or follows_adopted or newcomer.anonymous or seq.anonymous:
            assert not superseded
        elif seq.kind is RequestKind.GENERATE:
            assert superseded == (not is_prewarm and newcomer.supersede)
        elif is_prewarm and seq.tokens == newcomer.tokens:
            assert not superseded  # the same work: followed, never cut short
        else:
            assert superseded
    if not newcomer.anonymous:  # of the older named prewarms of the session, none computes on
        running = [
            s
            for s in session
            if s.kind is RequestKind.PREWARM
            and s.phase in COMPUTE_PHASES
            and not s.anonymous
            and s is not adopted
            and not any(s is t for t in plan.superseded)
        ]
        assert all(s.tokens == newcomer.tokens for s in running) and (is_prewarm or not running)
    # A plan is data: making it acted on nothing.
    assert [(s.phase, s.abort.is_set(), s.adopted_by, s.leader) for s in table] == before
    assert newcomer.resume_phase is None and newcomer.state is None and newcomer.leader is None


@given(scene=scenes())
def test_a_newcomer_that_already_adopted_adopts_no_other(scene: tuple[Drawn, list[Drawn]]) -> None:
    new, drawn = scene
    newcomer = build(NEWCOMER_ID, new)
    newcomer.resume_phase = Phase.PREFILLING  # as an earlier adoption leaves it
    plan = plan_supersede(newcomer, build_table(drawn))
    assert plan.adopted is None
    assert all(isinstance(step, (Join, Supersede)) for step in plan.steps)
