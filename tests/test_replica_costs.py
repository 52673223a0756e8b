"""The replica choice (actors/replica_costs.py, actors/replicas.py): the estimated time to first
token, in prefill tokens, decides; nothing is timed. A longer prefix wins when the queues are
equal, a busy replica loses once its queue outweighs the prefill it saves, new sessions spread."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from actors.replica_costs import Queued, RoutingCosts, cheapest, queue_tokens, replica_cost
from actors.replicas import ModelTable, Replicas
from runtime.kernel.core import ROUTER
from runtime.messages import ModelSpec
from runtime.testing.recording import RecordingContext

COSTS = RoutingCosts(decode_step_tokens=20, move_tokens=4)
NAMES = ("m@0", "m@1", "m@2")


def test_the_queue_counts_unfinished_prefills_and_one_step_if_any_request_decodes() -> None:
    queued = [Queued(100, False), Queued(None, False), Queued(30, False)]
    assert queue_tokens(queued, COSTS) == 100 + 0 + 30
    assert queue_tokens([*queued, Queued(7, True), Queued(None, True)], COSTS) == 130 + 20
    assert queue_tokens([], COSTS) == 0


def test_a_longer_prefix_wins_when_the_queues_are_equal() -> None:
    queues = {"m@0": 40, "m@1": 40}
    assert cheapest("m@0", 500, {"m@0": 10, "m@1": 300}, queues, {}, COSTS) == "m@1"
    # Not for fewer tokens than the move costs: the request stays where it is.
    assert cheapest("m@0", 500, {"m@0": 10, "m@1": 13}, queues, {}, COSTS) == "m@0"
    assert cheapest("m@0", 500, {"m@0": 10, "m@1": 15}, queues, {}, COSTS) == "m@1"


def test_a_busy_replica_loses_once_its_queue_outweighs_the_prefill_it_saves() -> None:
    matched = {"m@0": 0, "m@1": 300}  # m@1 saves 300 tokens of a 400-token prompt
    # 300 saved - 4 for the move: a queue of up to 295 more tokens there still wins.
    assert cheapest("m@0", 400, matched, {"m@0": 0, "m@1": 295}, {}, COSTS) == "m@1"
    assert cheapest("m@0", 400, matched, {"m@0": 0, "m@1": 297}, {}, COSTS) == "m@0"
    # The same from the other side: a request on the busy holder leaves it for an idle replica.
    assert cheapest("m@1", 400, matched, {"m@0": 0, "m@1": 500}, {}, COSTS) == "m@0"


def test_a_tie_stays_then_goes_to_the_replica_holding_the_least_cached_state() -> None:
    free = RoutingCosts(decode_step_tokens=20, move_tokens=0)
    queues = {"m@0": 0, "m@1": 0, "m@2": 0}
    assert cheapest("m@1", 50, {}, queues, {"m@1": 9, "m@2": 1}, free) == "m@1"
    others = {"m@0": 0, "m@2": 0}
    assert cheapest("m@1", 50, {}, others, {"m@0": 5, "m@2": 1}, free) == "m@2"


@given(
    prompt=st.integers(0, 2000),
    matched=st.lists(st.integers(0, 2000), min_size=3, max_size=3),
    queues=st.lists(st.integers(0, 3000), min_size=3, max_size=3),
    here=st.sampled_from(NAMES),
)
def test_the_choice_has_the_lowest_estimate_and_more_queue_never_attracts(
    prompt: int, matched: list[int], queues: list[int], here: str
) -> None:
    held = {n: min(m, prompt) for n, m in zip(NAMES, matched, strict=True)}
    queue = dict(zip(NAMES, queues, strict=True))
    chosen = cheapest(here, prompt, held, queue, {}, COSTS)
    cost = {n: replica_cost(queue[n], prompt, held[n], n != here, COSTS) for n in NAMES}
    assert cost[chosen] == min(cost.values())
    for other in NAMES:  # a replica not chosen is not chosen with more queued on it
        if other != chosen:
            busier = {**queue, other: queue[other] + 1}
            assert cheapest(here, prompt, held, busier, {}, COSTS) != other


class _Table:
    """The model table routing reads: two serving replicas, their live requests set by hand."""

    def __init__(self) -> None:
        self.on: dict[str, list[Queued]] = {"m@0": [], "m@1": []}

    def model_table(self) -> ModelTable:
        return ModelTable(
            load=lambda spec, asker, ctx: None,
            unload=lambda name, asker, ctx: None,
            knows=lambda name: False,  # nothing under the name itself: the replicas may load
            serving=lambda name: True,
            live=lambda name: len(self.on[name]),
            loaded=lambda name: None,
            queued=lambda name, besides: list(self.on[name]),
        )


def _replicas(table: _Table) -> Replicas:
    replicas = Replicas(table.model_table(), COSTS)
    spec = ModelSpec(name="m", backend="simulated", replicas=2)
    replicas.load(spec, ROUTER, RecordingContext(ROUTER))  # the table's load does nothing
    return replicas


def test_new_sessions_spread_to_the_replica_holding_less() -> None:
    table = _Table()
    replicas = _replicas(table)
    # A lookup on m@0 told the router m@0 holds 3 sessions' state, m@1 one's.
    assert replicas.destination("m", None, "m@0", 1, 10, {}, {"m@0": 3000, "m@1": 1000}) == "m@0"
    assert replicas.route("m", "new") == "m@1"  # both idle: the one holding less
    table.on["m@1"] = [Queued(None, False)]  # it is taken (not looked up yet): the other one
    assert replicas.route("m", "newer") == "m@0"
    # The queued work comes first: m@0 decoding one (20) is busier than m@1 prefilling 10.
    table.on = {"m@0": [Queued(None, True)], "m@1": [Queued(10, False)]}
    assert replicas.route("m", None) == "m@1"


def test_a_kept_session_moves_only_to_a_replica_holding_more_of_it() -> None:
    table = _Table()
    replicas = _replicas(table)
    assert replicas.route("m", "s") == "m@0"
    table.on["m@0"] = [Queued(300, False)] * 2  # far busier than a whole prefill elsewhere
    assert replicas.destination("m", "s", "m@0", 9, 100, {"m@0": 90}, {}) == "m@0"
    assert replicas.destination("m", None, "m@0", 9, 100, {"m@0": 90}, {}) == "m@1"
    assert replicas.destination("m", "s", "m@0", 9, 100, {"m@0": 0, "m@1": 90}, {}) == "m@1"


def test_a_reloaded_model_forgets_what_its_replicas_held() -> None:
    table = _Table()
    replicas = _replicas(table)
    replicas.destination("m", None, "m@0", 1, 10, {}, {"m@0": 3000, "m@1": 1000})
    assert replicas.route("m", None) == "m@1"
    assert replicas.unload("m", None, RecordingContext(ROUTER))
    replicas.load(ModelSpec(name="m", backend="simulated", replicas=2), ROUTER,
                  RecordingContext(ROUTER))  # fmt: skip
    assert replicas.route("m", None) == "m@0"  # both empty again: by name
