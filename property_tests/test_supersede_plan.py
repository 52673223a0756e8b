"""The supersede / adopt plan of a new generate, checked without an engine (docs/protocols.md).

``plan_supersede`` is a pure function of the generate and the engine's other sequences. Sequences
are drawn over two sessions, every phase, aborted or not, with prompts from a two-token alphabet so
that one prompt often extends another. The rules, as protocols.md states them:

- only live (not aborted, not ended) sequences of the generate's own session are touched;
- an older generate is superseded exactly when the new one has ``supersede`` set;
- every live prewarm of the session is either adopted or superseded, never left running;
- at most one prewarm is adopted: the first whose prefill target prefixes the generate's prompt
  while it computes (restoring, prefilling, decoding);
- the plan lists its steps in the sequences' order, and making it changes nothing.

Settings come from the active Hypothesis profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given
from hypothesis import strategies as st

from actors.engine.admission import Adopt, Supersede, plan_supersede
from actors.engine.sequence import COMPUTE_PHASES, Phase, Sequence
from runtime.messages import Admit, Generate, Prewarm, RequestKind, TokenIds

SESSIONS = ("m/default", "m/other")  # two namespaces' default sessions


@dataclass(frozen=True)
class Drawn:
    """One sequence as drawn: its request's kind and session, its prompt, where it stands."""

    kind: RequestKind
    session: str
    tokens: TokenIds | None
    phase: Phase
    aborted: bool
    supersede: bool


def build(sequence_id: int, drawn: Drawn) -> Sequence:
    namespace = drawn.session.removeprefix("m/")
    request: Generate | Prewarm
    if drawn.kind is RequestKind.GENERATE:
        request = Generate(
            request_id=f"r{sequence_id}",
            incarnation=sequence_id,
            model="m",
            prompt="text",
            namespace=namespace,
            supersede=drawn.supersede,
        )
    else:
        request = Prewarm(
            request_id=f"r{sequence_id}",
            incarnation=sequence_id,
            model="m",
            prompt="text",
            namespace=namespace,
        )
    admit = Admit(sequence_id=sequence_id, epoch=1, session=drawn.session, request=request)
    seq = Sequence.admitted(admit, "m")
    seq.tokens, seq.phase = drawn.tokens, drawn.phase
    if drawn.aborted:
        seq.abort.set()
    return seq


TAILS: tuple[TokenIds, ...] = ((), (1,), (2,))
prompts = st.lists(st.integers(min_value=1, max_value=2), min_size=1, max_size=5).map(tuple)


@st.composite
def scenes(draw: st.DrawFn) -> tuple[Drawn, list[Drawn]]:
    """A generate just tokenized (planned before it reserves), and the engine's other sequences."""
    new = Drawn(
        kind=RequestKind.GENERATE,
        session=draw(st.sampled_from(SESSIONS)),
        tokens=draw(prompts),
        phase=Phase.TOKENIZING,
        aborted=False,
        supersede=draw(st.booleans()),
    )
    assert new.tokens is not None
    # Often the generate's prompt cut short, maybe with a token of its own: an earlier keystroke's.
    cut = st.integers(min_value=0, max_value=len(new.tokens))
    related = st.builds(lambda n, extra: new.tokens[:n] + extra, cut, st.sampled_from(TAILS))
    # Weighted towards what the rules are about: live prewarms of the session that compute.
    phases = st.sampled_from(sorted(COMPUTE_PHASES, key=str)) | st.sampled_from(list(Phase))
    drawn: list[Drawn] = []
    for _ in range(draw(st.integers(min_value=0, max_value=6))):
        phase = draw(phases)
        tokens = draw(related | prompts)
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
            )
        )
    return new, drawn


def extends(generate: Sequence, prewarm: Sequence) -> bool:
    """Whether the prewarm's prefill target is a prefix of the generate's prompt."""
    assert generate.tokens is not None
    if not prewarm.tokens:
        return False
    target = prewarm.tokens[: prewarm.prefill_target]
    return generate.tokens[: len(target)] == target


def prewarm(tokens: TokenIds, phase: Phase, session: str = SESSIONS[0]) -> Drawn:
    return Drawn(RequestKind.PREWARM, session, tokens, phase, aborted=False, supersede=False)


TYPED = Drawn(RequestKind.GENERATE, SESSIONS[0], (1, 2, 1), Phase.TOKENIZING, False, False)


@given(scene=scenes())
# The cases each rule turns on, always run besides the drawn ones.
@example(scene=(TYPED, [prewarm((1, 2, 1, 2), Phase.DONE), prewarm((1, 2), Phase.PREFILLING)]))
@example(scene=(TYPED, [prewarm((1, 2), Phase.LOOKING_UP), prewarm((1, 2), Phase.RESTORING)]))
@example(scene=(TYPED, [prewarm((1, 2), Phase.DECODING), prewarm((1, 2, 1), Phase.PREFILLING)]))
@example(scene=(TYPED, [prewarm((2, 2), Phase.PREFILLING), prewarm((1, 2), Phase.PREFILLING)]))
@example(scene=(TYPED, [prewarm((1, 2), Phase.PREFILLING, SESSIONS[1])]))
def test_the_plan_follows_the_supersede_and_adopt_rules(scene: tuple[Drawn, list[Drawn]]) -> None:
    new, drawn = scene
    generate = build(0, new)
    table = [build(i + 1, d) for i, d in enumerate(drawn)]
    before = [(s.phase, s.abort.is_set(), s.adopted_by) for s in table]

    plan = plan_supersede(generate, [generate, *table])

    live = [
        s
        for s in table
        if s.session == generate.session and not s.abort.is_set() and s.phase is not Phase.DONE
    ]
    touched = [step.prewarm if isinstance(step, Adopt) else step.older for step in plan.steps]
    # Only live sequences of its session, each at most once, in the table's order.
    assert all(any(s is t for s in live) for t in touched)
    assert [id(t) for t in touched] == [id(s) for s in live if any(s is t for t in touched)]
    for seq in live:
        if seq.kind is RequestKind.GENERATE:
            assert any(seq is t for t in plan.superseded) == generate.supersede
        else:  # a live prewarm of the session never keeps running beside the generate
            assert sum(seq is t for t in touched) == 1
    adoptable = [
        s
        for s in live
        if s.kind is RequestKind.PREWARM and s.phase in COMPUTE_PHASES and extends(generate, s)
    ]
    assert plan.adopted is (adoptable[0] if adoptable else None)
    assert all(any(s is t for t in plan.superseded) for s in adoptable[1:])
    # A plan is data: making it acted on nothing.
    assert [(s.phase, s.abort.is_set(), s.adopted_by) for s in table] == before
    assert generate.resume_phase is None and generate.state is None


@given(scene=scenes())
def test_a_generate_that_already_adopted_adopts_no_other(scene: tuple[Drawn, list[Drawn]]) -> None:
    new, drawn = scene
    generate = build(0, new)
    generate.resume_phase = Phase.PREFILLING  # as an earlier adoption leaves it
    plan = plan_supersede(generate, [build(i + 1, d) for i, d in enumerate(drawn)])
    assert plan.adopted is None
    assert all(isinstance(step, Supersede) for step in plan.steps)
