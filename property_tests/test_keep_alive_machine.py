"""Keep-alive and auto-load on the simulator, against their invariants (docs/protocols.md).

One model with a short keep-alive, never unloaded on purpose: every unload is the keep-alive's.
Hypothesis picks the seed (which actor runs next), the keep-alive and a program of requests,
cancels, message deliveries and waits, so requests meet the idle timer at every point of its life
(before it fires, as it fires, while the model drains, while it loads again). Checked:

- an idle unload never cuts a request short: no request ever ends ``model_unloaded``;
- no request is lost: none is refused (the model is always available), each ends exactly once,
  and a finished one has the greedy tokens a cold run gives;
- at the end the model is idle and every byte of KV is back in the budget.
"""

from __future__ import annotations

import msgspec
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime.backends.simulated import greedy_continuation
from runtime.host.config import RuntimeConfig
from runtime.messages import (
    Cancel,
    Cancelled,
    Failed,
    Finished,
    FinishReason,
    Generate,
    ListModels,
    ModelLoaded,
    ModelsListed,
    Rejected,
)
from runtime.testing.harness import kv_keeper, router, sim_spec
from runtime.testing.requests import generate
from runtime.testing.simulator import Simulator

REQUEST_IDS = ("r1", "r2", "r3")
ENDS = (Finished, Cancelled, Failed, Rejected)
prompts = st.lists(st.sampled_from([97, 98, 99]), min_size=1, max_size=10).map(tuple)


class KeepAliveMachine(RuleBasedStateMachine):
    @initialize(seed=st.integers(0, 2**16), keep_alive_s=st.sampled_from([0.0, 0.01, 0.05]))
    def start(self, seed: int, keep_alive_s: float) -> None:
        self.sim = Simulator(seed=seed, config=RuntimeConfig(kv_budget_bytes=1 << 20))
        spec = sim_spec(
            "m",
            chunk=3,
            bytes_per_token=100,
            prefill_s_per_token=0.001,
            decode_s_per_token=0.002,
            load_s=0.01,  # long enough for requests to arrive while it loads again
        )
        reply = self.sim.load(msgspec.structs.replace(spec, keep_alive_s=keep_alive_s))
        assert isinstance(reply, ModelLoaded)
        self.sent: dict[tuple[str, int], Generate] = {}
        self.incarnation = 0

    @rule(request_id=st.sampled_from(REQUEST_IDS), prompt=prompts, max_tokens=st.integers(1, 5))
    def generate(self, request_id: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        self.incarnation += 1
        request = generate(
            f"{request_id}.{self.incarnation}", prompt, max_tokens, incarnation=self.incarnation
        )
        self.sent[(request.request_id, request.incarnation)] = request
        self.sim.send(request)

    @precondition(lambda self: bool(self.sent))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.sent)))
        self.sim.send(Cancel(request_id=key[0], incarnation=key[1]))

    @rule(steps=st.integers(1, 15))
    def deliver(self, steps: int) -> None:
        for _ in range(steps):
            if not self.sim.step():
                break

    @rule(seconds=st.sampled_from([0.001, 0.005, 0.02, 0.1]))
    def advance(self, seconds: float) -> None:
        self.sim.advance(seconds)

    @rule()
    def fire_next_timer(self) -> None:
        # The one timer alone: requests then meet an IdleCheck in the mailbox, a drain, a load.
        self.sim.fire_next_timer()

    @invariant()
    def no_request_is_cut_short_or_refused(self) -> None:
        for key in self.sent:
            events = self.sim.events(*key)
            ends = [i for i, e in enumerate(events) if isinstance(e, ENDS)]
            assert ends in ([], [len(events) - 1]), (key, events)
            if not ends:
                continue
            end = events[-1]
            assert not isinstance(end, Rejected), (key, end)
            assert not isinstance(end, Failed), (key, end)
            assert not (isinstance(end, Cancelled) and end.reason == "model_unloaded"), (key, end)
            if isinstance(end, Finished):
                request = self.sent[key].request
                expected = greedy_continuation(list(request.prompt_tokens or ()), 5)
                tokens = self.sim.emitted_tokens(*key)
                assert tokens == expected[: len(tokens)], (key, tokens)
                assert end.reason is not FinishReason.LENGTH or len(tokens) == request.max_tokens

    def teardown(self) -> None:
        if not hasattr(self, "sim"):
            return
        self.sim.run_until_quiescent()
        for key in self.sent:
            assert self.sim.terminal(*key) is not None, f"{key} never ended"
        unloads = router(self.sim).counters.snapshot().get("models_idle_unloaded", 0)
        event(f"idle unloads: {min(unloads, 3)}{'+' if unloads > 3 else ''}")
        event(f"parked: {min(router(self.sim).counters.snapshot().get('requests_parked', 0), 1)}")
        listed = self.sim.ask(ListModels())
        assert isinstance(listed, ModelsListed)
        assert [(s.name, s.state) for s in listed.models] == [("m", "idle")]
        assert kv_keeper(self.sim).reserved_bytes == 0


TestKeepAliveMachine = KeepAliveMachine.TestCase
