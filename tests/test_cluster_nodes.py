"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``), one CPU each, joined by address:
a model's two replicas are placed one per node (each engine asks for one CPU), both serve, and
when one node is lost the other replica serves on while the lost one, with nowhere to go, is
refused with a typed error naming what the cluster lacks, rather than waiting forever. Each node's
KV is budgeted on that node: the worker's budget is set by its node id, the head has the
per-node default, each engine plans against its node's budget, and a stream's bytes are booked on
its engine's node, never on the host."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from runtime.cluster.options import ClusterConfig
from runtime.host.api import Runtime
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import engine_model
from runtime.messages import Failed, Finished, ModelSpec, TokensEmitted
from runtime.testing.tiny_models import tiny_model_path
from tests.loop_checks import LoopBackend, on_asyncio

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.mlx]


@pytest.fixture(scope="module")
def anyio_backend() -> LoopBackend:
    return on_asyncio()  # one loop: a two-node cluster costs seconds


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[tuple[object, object]]:
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False},
    )
    worker = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster, worker
    cluster.shutdown()


async def test_two_replicas_land_on_two_nodes_and_survive_the_loss_of_one(
    two_nodes: tuple[object, object],
) -> None:
    cluster, worker = two_nodes
    address = cluster.address  # type: ignore[attr-defined]
    spec = ModelSpec(name="llama", path=str(tiny_model_path("llama")), backend="mlx", replicas=2)
    worker_id = worker.node_id  # type: ignore[attr-defined]
    joined = ClusterConfig(
        address=address,
        placement_timeout_s=10,
        unresponsive_s=10,
        kv_budget_bytes_per_node=1 << 27,
        node_kv_budget_bytes={worker_id: 3 << 26},
    )
    with anyio.fail_after(240):
        async with Runtime(RuntimeConfig(kv_budget_bytes=1 << 28, cluster=joined)) as rt:
            await rt.load_model(spec)
            where = {s.name: s.placement for s in await rt.list_models()}
            nodes = {text.split()[1] for text in where.values()}
            assert len(nodes) == 2, where  # one CPU per node: one replica per node
            # Each engine plans (its checkpoints) against its own node's budget.
            planned = {
                engine_model(address): stats.gauges["kv_budget_bytes"]
                for address, stats in rt.stats().actors.items()
                if engine_model(address) in where
            }
            on_worker = {n for n, text in where.items() if worker_id.startswith(text.split()[1])}
            assert len(on_worker) == 1  # "node <id's first 8 hex digits> pid <pid>"
            assert planned == {n: 3 << 26 if n in on_worker else 1 << 27 for n in where}, planned
            stream = rt.generate("llama", "The weather today is", max_tokens=1500, session="x")
            async with stream:
                async for event in stream:
                    if isinstance(event, TokensEmitted):
                        break
                kv = rt.stats().actors["kv"].gauges
                budgets = {k.split(":", 1)[1]: v for k, v in kv.items() if "node_budget:" in k}
                assert budgets.pop("host") == 1 << 28 and budgets.pop(worker_id) == 3 << 26
                assert list(budgets.values()) == [1 << 27]  # the head: the per-node default
                on_nodes = sum(v for k, v in kv.items() if k.startswith("node_reserved:"))
                assert kv["node_reserved:host"] == 0 and on_nodes == kv["reserved"] > 0
                cluster.remove_node(worker)  # type: ignore[attr-defined]
                end = [e async for e in stream][-1]
            # The stream was on either node: it finished, or failed retryably with its node.
            assert isinstance(end, Finished) or (isinstance(end, Failed) and end.retryable)

            # The lost replica cannot come back: the cluster has one CPU for two engines now.
            with anyio.fail_after(120):
                while sorted(s.state for s in await rt.list_models()) != ["failed", "loaded"]:
                    await rt.wait_progress()
            (failed,) = [s for s in await rt.list_models() if s.state == "failed"]
            assert "need 2 CPU" in failed.failure and "has 1" in failed.failure
            done = await rt.complete("llama", "Hello there", max_tokens=4)
            assert isinstance(done.terminal, Finished)  # the replica left serves
