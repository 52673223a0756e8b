"""Each node's KV budgeted on that node: the keeper's per-node ledgers against a simple model.

Replicas of a model run on nodes (Ray nodes with budgets given by node id, by IP, or the default;
or the host). Rules reserve, release, transfer and let time pass, and end an engine's epoch every
way one ends (it drains and releases its epoch itself, or its process is lost and the real
``LostEngine`` releases it), after which the replica restarts at a new epoch on a drawn node (its
proxy's ``EnginePlaced`` first, as the proxy sends it). After every step: no node is over its
budget, each node's reserved bytes are its holders' bytes, every holder sits on its engine's node,
nothing of an ended epoch holds or waits, each node's queue head does not fit that node, and an
``Evict`` names only one node's model epochs. At the end every epoch is lost and nothing is held.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from actors.engine.lost import LostEngine
from actors.kv_budget import KVBudgetCore
from actors.kv_ledgers import HOST_NODE
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, engine_address
from runtime.messages import (
    EnginePlaced,
    Evict,
    Holder,
    HolderKind,
    Release,
    ReleaseEpoch,
    Reserve,
    Transfer,
)
from runtime.testing.recording import RecordingContext

HOST_BUDGET = 500
DEFAULT_NODE_BUDGET = 300
# node id -> its IP; node-a's budget is given by id, node-b's by IP, node-c has the default.
NODES = {"node-a": "10.0.0.1", "node-b": "10.0.0.2", "node-c": "10.0.0.3"}
NODE_BUDGETS = {"node-a": 600, "10.0.0.2": 400}
BUDGETS = {HOST_NODE: HOST_BUDGET, "node-a": 600, "node-b": 400, "node-c": DEFAULT_NODE_BUDGET}
REPLICAS = ("m@0", "m@1", "m@2")
SLOTS = ((HolderKind.SEQUENCE, 0), (HolderKind.SEQUENCE, 1), (HolderKind.PREFIX_ENTRY, 0))

sizes = st.one_of(st.integers(1, 300), st.integers(0, 700))
timeouts = st.one_of(st.just(0.0), st.integers(1, 20).map(float))
places = st.sampled_from((HOST_NODE, *NODES))


class KVNodesMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = RecordingContext(KV_KEEPER)
        self.keeper = KVBudgetCore(
            HOST_BUDGET,
            default_timeout_s=10.0,
            node_budgets=NODE_BUDGETS,
            node_default_bytes=DEFAULT_NODE_BUDGET,
        )
        self.epoch = dict.fromkeys(REPLICAS, 0)
        self.node_of_epoch: dict[tuple[str, int], str] = {}
        self.next_epoch = 1
        for replica in REPLICAS:
            self.restart(replica, "node-a")

    # ------------------------------------------------------------------ driving the keeper

    def deliver(self, message: object, sender: str) -> None:
        self.keeper.handle(message, sender, self.ctx)  # type: ignore[arg-type]
        for timer in self.ctx.due_timers():
            self.keeper.handle(timer, KV_KEEPER, self.ctx)
        for to, sent in self.ctx.take_sent():
            if isinstance(sent, Evict):
                assert to == PREFIX_CACHE
                # A node's shortfall is asked of that node's entries only.
                assert sent.epochs is not None
                assert len({self.node_of_epoch[pair] for pair in sent.epochs}) <= 1

    def restart(self, replica: str, node: str) -> None:
        """A new epoch of ``replica`` on ``node``: its proxy announces where it runs first."""
        epoch = self.next_epoch
        self.next_epoch += 1
        self.epoch[replica] = epoch
        self.node_of_epoch[(replica, epoch)] = node
        if node != HOST_NODE:
            placed = EnginePlaced(model=replica, epoch=epoch, node=node, node_ip=NODES[node])
            self.deliver(placed, engine_address(replica, epoch))

    def holder(self, replica: str, slot: tuple[HolderKind, int]) -> Holder:
        return Holder(model=replica, epoch=self.epoch[replica], kind=slot[0], id=slot[1])

    # ------------------------------------------------------------------ rules

    @rule(
        replica=st.sampled_from(REPLICAS),
        slot=st.sampled_from(SLOTS),
        nbytes=sizes,
        timeout=timeouts,
    )
    def reserve(
        self, replica: str, slot: tuple[HolderKind, int], nbytes: int, timeout: float
    ) -> None:
        holder = self.holder(replica, slot)
        reserve = Reserve(holder=holder, nbytes=nbytes, timeout_s=timeout)
        self.deliver(reserve, engine_address(replica, holder.epoch))

    @rule(replica=st.sampled_from(REPLICAS), slot=st.sampled_from(SLOTS), part=st.booleans())
    def release(self, replica: str, slot: tuple[HolderKind, int], part: bool) -> None:
        holder = self.holder(replica, slot)
        release = Release(holder=holder, nbytes=50 if part else None)
        self.deliver(release, engine_address(replica, holder.epoch))

    @rule(replica=st.sampled_from(REPLICAS), slot=st.sampled_from(SLOTS), nbytes=sizes)
    def commit_entry(self, replica: str, slot: tuple[HolderKind, int], nbytes: int) -> None:
        """A sequence's bytes become a prefix entry's (its state is kept in the cache)."""
        source = self.holder(replica, slot)
        target = Holder(model=replica, epoch=source.epoch, kind=HolderKind.PREFIX_ENTRY, id=7)
        transfer = Transfer(source=source, target=target, nbytes=nbytes)
        self.deliver(transfer, engine_address(replica, source.epoch))

    @rule(seconds=st.integers(1, 15))
    def time_passes(self, seconds: int) -> None:
        self.ctx.clock += seconds
        self.deliver(Release(holder=self.holder("m@0", SLOTS[0]), nbytes=0), "engine:m@0")

    @rule(replica=st.sampled_from(REPLICAS), node=places)
    def drained(self, replica: str, node: str) -> None:
        """The engine drained: it releases its epoch itself; the replica loads again."""
        epoch = self.epoch[replica]
        self.deliver(ReleaseEpoch(model=replica, epoch=epoch), engine_address(replica, epoch))
        self.restart(replica, node)

    @rule(replica=st.sampled_from(REPLICAS), node=places)
    def process_lost(self, replica: str, node: str) -> None:
        """The engine's process is gone: its stand-in releases what it held."""
        self.lose(replica)
        self.restart(replica, node)

    def lose(self, replica: str) -> None:
        epoch = self.epoch[replica]
        lost_ctx = RecordingContext(engine_address(replica, epoch))
        LostEngine(replica, epoch, "killed").on_start(lost_ctx)
        for to, message in lost_ctx.take_sent():
            if to == KV_KEEPER:
                self.deliver(message, lost_ctx.self_address)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def no_node_over_its_budget(self) -> None:
        held: dict[str, int] = dict.fromkeys(BUDGETS, 0)
        for holder, nbytes in self.keeper.holdings().items():
            node = self.keeper.node_of(holder)
            assert node == self.node_of_epoch[(holder.model, holder.epoch)]
            held[node] += nbytes
        for node, (budget, reserved) in self.keeper.nodes().items():
            assert budget == BUDGETS[node]
            assert 0 <= reserved <= budget
            assert reserved == held[node]

    @invariant()
    def nothing_of_an_ended_epoch(self) -> None:
        current = {(replica, epoch) for replica, epoch in self.epoch.items()}
        for holder in self.keeper.holdings():
            assert (holder.model, holder.epoch) in current
        for queued in self.keeper.queued():
            assert (queued.holder.model, queued.holder.epoch) in current

    @invariant()
    def each_queue_head_does_not_fit_its_node(self) -> None:
        heads: dict[str, int] = {}
        for queued in self.keeper.queued():
            node = self.node_of_epoch[(queued.holder.model, queued.holder.epoch)]
            heads.setdefault(node, queued.nbytes)
        nodes = self.keeper.nodes()
        for node, nbytes in heads.items():
            budget, reserved = nodes[node]
            assert nbytes > budget - reserved

    def teardown(self) -> None:
        for replica in REPLICAS:
            self.lose(replica)
        assert self.keeper.reserved_bytes == 0
        assert not self.keeper.holdings()
        assert not self.keeper.queued()


TestKVNodes = KVNodesMachine.TestCase
