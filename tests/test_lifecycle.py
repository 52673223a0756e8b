"""A sequence's lifecycle is a table (actors/engine/lifecycle.py): the table is complete, every
move goes through ``Sequence.move``, and only the compute slot marks a sequence in compute."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.engine.lifecycle import COMPUTE_PHASES, LEGAL_MOVES, IllegalMove, Phase
from actors.engine.sequence import Sequence
from runtime.messages import Admit
from runtime.testing import requests

ENGINE = Path(__file__).resolve().parent.parent / "actors" / "engine"


def _seq() -> Sequence:
    request = requests.prewarm("r1", None)
    return Sequence.admitted(Admit(sequence_id=1, epoch=1, session="s", request=request), "m")


def test_the_table_has_an_entry_for_every_phase() -> None:
    assert set(LEGAL_MOVES) == set(Phase)
    assert all(targets <= set(Phase) for targets in LEGAL_MOVES.values())


def test_every_live_phase_may_end_and_an_ended_one_moves_no_more() -> None:
    assert LEGAL_MOVES[Phase.DONE] == frozenset()
    assert all(Phase.DONE in LEGAL_MOVES[p] for p in Phase if p is not Phase.DONE)


def test_every_phase_is_reachable_from_tokenizing_and_no_move_goes_back_to_it() -> None:
    seen, frontier = {Phase.TOKENIZING}, [Phase.TOKENIZING]
    while frontier:
        for target in LEGAL_MOVES[frontier.pop()] - seen:
            seen.add(target)
            frontier.append(target)
    assert seen == set(Phase)
    assert all(Phase.TOKENIZING not in targets for targets in LEGAL_MOVES.values())


def test_a_compute_phase_is_left_only_forward() -> None:
    # Once computing, a sequence never goes back to waiting for the gate, the keeper or a lookup.
    for phase in COMPUTE_PHASES:
        assert LEGAL_MOVES[phase] <= COMPUTE_PHASES | {Phase.DONE}


def test_a_legal_move_changes_the_phase() -> None:
    seq = _seq()
    seq.move(Phase.RESERVING)
    seq.move(Phase.LOOKING_UP)
    seq.move(Phase.RESTORING)
    assert seq.phase is Phase.RESTORING


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ((), Phase.DECODING),  # a prompt not tokenized cannot decode
        ((Phase.RESERVING, Phase.LOOKING_UP, Phase.RESTORING), Phase.WAITING),
        ((Phase.DONE,), Phase.DONE),  # a sequence ends once
    ],
)
def test_an_illegal_move_raises_and_leaves_the_phase_as_it_was(
    path: tuple[Phase, ...], illegal: Phase
) -> None:
    seq = _seq()
    for phase in path:
        seq.move(phase)
    before = seq.phase
    with pytest.raises(IllegalMove, match=f"from {before.name} to {illegal.name}"):
        seq.move(illegal)
    assert seq.phase is before


def _assignments(pattern: str) -> list[str]:
    found = []
    for module in sorted(ENGINE.glob("*.py")):
        for number, line in enumerate(module.read_text().splitlines(), 1):
            if re.search(pattern, line):
                found.append(f"{module.name}:{number}")
    return found


def test_every_phase_change_goes_through_move() -> None:
    assigned = _assignments(r"\.phase\s*=[^=]")
    assert [where.split(":")[0] for where in assigned] == ["sequence.py"], assigned


def test_only_the_compute_slot_marks_a_sequence_in_compute() -> None:
    assigned = _assignments(r"in_compute\s*=[^=]")
    assert {where.split(":")[0] for where in assigned} == {"compute.py"}, assigned
