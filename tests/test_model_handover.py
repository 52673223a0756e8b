"""The engine hands its model (and draft model) to the parts that use it once, at the load, and
takes them back at the close (actors/engine/core.py ``_hand_over``): the close still gets both."""

from __future__ import annotations

import pytest

from runtime.backends.simulated import SimulatedBackend
from runtime.messages import ModelUnloaded, UnloadModel
from runtime.testing.harness import make_sim, sim_spec


def test_an_unload_closes_the_model_and_its_draft_model(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[SimulatedBackend] = []
    monkeypatch.setattr(SimulatedBackend, "close", lambda self: closed.append(self))
    # A simulated model drafting for itself: the target and the draft are two backends.
    sim = make_sim(sim_spec("m", context_length=512, draft_model="m", draft_cost=0.01))
    assert isinstance(sim.ask(UnloadModel(model="m")), ModelUnloaded)
    sim.run_until_quiescent()
    assert len({id(backend) for backend in closed}) == 2, "the target and its draft model"
