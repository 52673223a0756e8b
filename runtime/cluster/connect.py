"""Reaching a Ray cluster, and starting engine processes on it, bounded in time.

``connect`` joins the cluster a ``ClusterConfig`` names (or starts a local Ray: loopback, no
dashboard, bounded CPUs), in a thread with a deadline, after checking that a named head answers
on TCP at all, so an unreachable address is a typed error (``ClusterUnavailable``) within
``connect_timeout_s`` rather than Ray's own long retries. ``ClusterLink.missing`` says why a
model's engines can never be placed (the cluster has less of a resource, in all, than they ask
for); what is merely busy now is left to the placement deadline (``RemoteEngine``).
"""

from __future__ import annotations

import logging
import os
import pathlib
import socket
import threading
from typing import Any

from actors.standing import BuildOnNode
from runtime.cluster.options import ClusterConfig
from runtime.cluster.proxy import EngineLink, RemoteEngine
from runtime.errors import ClusterUnavailable
from runtime.kernel.core import ActorCore, Address
from runtime.messages import ModelSpec

log = logging.getLogger("mlx_actor_runtime.cluster")

# Ray nices its workers by 15 by default, so an engine would compute at a lower priority than the
# host it serves: under load its prefills lose the CPU (docs/cluster.md, "Figures"). Not here.
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0}

_KEEPER: _RayKeeper | None = None  # the Ray this process started, shared by its Runtimes


def connect(config: ClusterConfig) -> ClusterLink:
    """Join (or start) the Ray cluster; raises ``ClusterUnavailable`` naming what is missing."""
    global _KEEPER
    try:
        import ray
    except ImportError as error:
        raise ClusterUnavailable(
            "Ray is not installed; install the cluster extra: pip install "
            "'mlx-actor-runtime[cluster]'"
        ) from error
    address = config.address
    if address not in (None, "auto", "local"):
        check_reachable(address, config.connect_timeout_s)
    if ray.is_initialized():  # joined already: by another Runtime here (shared), or by the host
        if _KEEPER is not None:
            _KEEPER.users += 1
        return ClusterLink(config, keeper=_KEEPER)
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")  # a killed engine's pending calls
    if address in (None, "local"):
        _share_code_path()
    keeper = _RayKeeper(address, config.num_cpus)
    where = "a local Ray" if address in (None, "local") else f"the Ray cluster at {address!r}"
    if not keeper.started.wait(config.connect_timeout_s):
        raise ClusterUnavailable(
            f"could not reach {where} within {config.connect_timeout_s:g} s; check that it runs "
            "(`ray status`) or raise ClusterConfig.connect_timeout_s"
        )
    if keeper.failure is not None:
        raise ClusterUnavailable(f"could not reach {where}: {keeper.failure}") from keeper.failure
    _KEEPER = keeper
    return ClusterLink(config, keeper=keeper)


class _RayKeeper:
    """The thread that starts Ray and lives until it is shut down. Ray's processes die with the
    thread that started them (they are spawned with a parent-death signal, and Linux ties that to
    the thread), so the start cannot run on a passing worker thread; nor on the event loop, which
    it would block for seconds."""

    def __init__(self, address: str | None, num_cpus: int | None) -> None:
        self._address = address
        self._num_cpus = num_cpus
        self.started = threading.Event()
        self.failure: BaseException | None = None
        self.users = 1  # the Runtimes of this process on this Ray: the last one to leave stops it
        self._leave = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ray", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        try:
            if self._address in (None, "local"):
                ray.init(num_cpus=self._num_cpus, include_dashboard=False,
                         _node_ip_address="127.0.0.1", log_to_driver=False,
                         _system_config=LOCAL_SYSTEM_CONFIG)  # fmt: skip
            else:
                ray.init(address=self._address, log_to_driver=False)
        except BaseException as error:  # handed to the connecting thread
            self.failure = error
            self.started.set()
            return
        self.started.set()
        self._leave.wait()
        ray.shutdown()

    def close(self, timeout_s: float = 30.0) -> None:
        """One user leaves; the last one shuts Ray down (here, on the thread that started it)."""
        global _KEEPER
        self.users -= 1
        if self.users > 0:
            return
        if _KEEPER is self:
            _KEEPER = None
        self._leave.set()
        self._thread.join(timeout_s)


class ClusterLink:
    """This runtime's hold on the cluster: starts engine processes, and leaves it at the end."""

    def __init__(self, config: ClusterConfig, *, keeper: _RayKeeper | None) -> None:
        import ray

        self._config = config
        self._keeper = keeper  # set: Ray started here; this runtime is one of its users
        self._actor_class: Any = ray.remote(
            num_cpus=config.engine_num_cpus,
            num_gpus=config.engine_num_gpus,
            resources=dict(config.engine_resources),
            max_restarts=0,  # the router restarts an engine, as a new actor at a new epoch
        )(_engine_process_class())

    def wrap(self, spec: ModelSpec, epoch: int, build: BuildOnNode) -> ActorCore:
        """The router's engine factory for ``spec``: a proxy to a process running ``build`` on
        the node Ray places it on."""
        return RemoteEngine(spec.name, epoch, build, self._link(), spec.replicas)

    def _link(self) -> EngineLink:
        config = self._config
        return EngineLink(
            start_engine=self._start_engine,
            kill=_kill,
            missing=self.missing,
            needs=config.engine_needs(),
            poll_s=config.poll_s,
            placement_timeout_s=config.placement_timeout_s,
            unresponsive_s=config.unresponsive_s,
            grant_with_lookup=config.grant_with_lookup,
        )

    def _start_engine(self, address: Address, build: BuildOnNode) -> Any:
        return self._actor_class.remote(address, build)

    def missing(self, replicas: int = 1) -> str | None:
        """Why ``replicas`` engines can never be placed on this cluster, or None."""
        import ray

        totals: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        for name, amount in self._config.engine_needs().items():
            wanted, has = amount * replicas, totals.get(name, 0.0)
            if wanted > has:
                return (
                    f"{replicas} engine process(es) need {wanted:g} {name} and the whole Ray "
                    f"cluster has {has:g}; add a node with {name}, or lower "
                    "ClusterConfig.engine_num_cpus / engine_num_gpus / engine_resources"
                )
        return None

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()


def _engine_process_class() -> type:
    from runtime.cluster.process import EngineProcess

    return EngineProcess


def _kill(handle: Any) -> None:
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception as error:  # already gone, or Ray is shutting down: nothing left to kill
        log.debug("ray.kill: %s", error)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A head not accepting TCP at ``address`` is refused at once, not after Ray's retries."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ClusterUnavailable(
            f"the Ray address {address!r} is not HOST:PORT (or 'auto' to join this machine's "
            "cluster); `ray start --head` prints the address to use"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=min(timeout_s, 5.0)):
            pass
    except OSError as error:
        raise ClusterUnavailable(
            f"no Ray head answers at {address!r} ({error.strerror or error}); start one with "
            "`ray start --head --port PORT` there, or fix the address"
        ) from error


def _share_code_path() -> None:
    """Local workers import the same ``runtime`` as this host (a checkout, not an install)."""
    root = str(pathlib.Path(__file__).resolve().parents[2])  # above runtime/
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, *paths) if p)
