"""What the project's tests share (hosts' own tests may use it too).

On the simulator: ``sim_spec`` and ``make_sim`` build a simulator with simulated models loaded,
and ``kv_keeper``, ``prefix_cache``, ``router`` and ``engine`` return its actors' cores as their
concrete types. An engine is found by its model's newest epoch, never by a written-out address.

On the production transport: ``wait_until`` waits for a condition on a ``Runtime`` (or an
``ActorSystem``) by waking each time an actor handles a message, and ``engine_stats`` reads the
statistics of the engine a ``load_model`` started.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

import anyio
import msgspec

from actors.engine.core import EngineCore
from actors.kv_budget import KVBudgetCore
from actors.prefix_cache import PrefixCacheCore
from actors.router import RouterCore
from runtime.host.config import RuntimeConfig
from runtime.kernel.core import KV_KEEPER, PREFIX_CACHE, ROUTER, Address, engine_address
from runtime.messages import ModelLoaded, ModelSpec, Stats
from runtime.messages import common_prefix_length as common_prefix_length  # for hosts' tests
from runtime.testing.faults import FaultPlan, FaultyKeeper
from runtime.testing.simulator import Simulator

if TYPE_CHECKING:
    from runtime.host.api import Runtime

ModelOption = str | int | float | bool | None
DEFAULT_BUDGET = 64 << 20
_Core = TypeVar("_Core")


# --------------------------------------------------------------------------- the simulator


def sim_spec(name: str = "m", /, *, chunk: int | None = None, **options: ModelOption) -> ModelSpec:
    """A ``ModelSpec`` of the simulated backend: ``chunk`` prefill tokens per step, and
    ``options`` as the backend reads them (``bytes_per_token``, ``prefill_s_per_token``...)."""
    return ModelSpec(name=name, backend="simulated", prefill_chunk_tokens=chunk, options=options)


def make_sim(
    *specs: ModelSpec,
    seed: int = 0,
    budget: int = DEFAULT_BUDGET,
    reservation_timeout_s: float | None = None,
    faults: FaultPlan | None = None,
    **config_fields: object,
) -> Simulator:
    """A simulator with a KV budget of ``budget`` bytes and each of ``specs`` loaded, in order.

    ``reservation_timeout_s`` None keeps ``RuntimeConfig``'s default; ``config_fields`` set other
    ``RuntimeConfig`` fields (``step_timeout_s``, ``engine_restart``). ``faults``: the plan its
    backends and KV keeper consult (runtime/testing/faults.py). Raises ``RuntimeError`` when a
    model does not load (the reply is in the message).
    """
    config = RuntimeConfig(kv_budget_bytes=budget)
    if reservation_timeout_s is not None:
        config = msgspec.structs.replace(config, reservation_timeout_s=reservation_timeout_s)
    if config_fields:
        config = msgspec.structs.replace(config, **config_fields)
    sim = Simulator(seed=seed, config=config, faults=faults)
    for spec in specs:
        reply = sim.load(spec)
        if not isinstance(reply, ModelLoaded):
            raise RuntimeError(f"model {spec.name!r} did not load: {reply!r}")
    return sim


def kv_keeper(sim: Simulator) -> KVBudgetCore:
    """The simulator's KV budget keeper (inside its fault wrapper, when it has one)."""
    core = sim.core(KV_KEEPER)
    if isinstance(core, FaultyKeeper):
        return _core_at_inner(core.inner, KVBudgetCore)
    return _core_at(sim, KV_KEEPER, KVBudgetCore)


def prefix_cache(sim: Simulator) -> PrefixCacheCore:
    """The simulator's prefix-cache manager."""
    return _core_at(sim, PREFIX_CACHE, PrefixCacheCore)


def router(sim: Simulator) -> RouterCore:
    """The simulator's router."""
    return _core_at(sim, ROUTER, RouterCore)


def engines(sim: Simulator) -> list[EngineCore]:
    """Every engine the simulator runs, of every model, older epochs still stopping included."""
    return [core for a in sim.addresses() if isinstance(core := sim.core(a), EngineCore)]


def engine_address_of(sim: Simulator, model: str = "m") -> Address:
    """The address of ``model``'s current engine: the one of its newest epoch (epochs only
    grow). Raises ``LookupError`` when no engine of ``model`` runs."""
    epochs = [core.epoch for core in engines(sim) if core.model == model]
    if not epochs:
        raise LookupError(f"no engine of model {model!r} runs; actors: {sim.addresses()}")
    return engine_address(model, max(epochs))


def engine(sim: Simulator, model: str = "m") -> EngineCore:
    """``model``'s current engine (see ``engine_address_of``); raises ``LookupError``."""
    return _core_at(sim, engine_address_of(sim, model), EngineCore)


def _core_at(sim: Simulator, address: Address, kind: type[_Core]) -> _Core:
    return _core_at_inner(sim.core(address), kind, address)


def _core_at_inner(core: object, kind: type[_Core], address: Address = KV_KEEPER) -> _Core:
    if not isinstance(core, kind):
        raise LookupError(f"expected a {kind.__name__} at {address!r}, found {core!r}")
    return core


# --------------------------------------------------------------------------- production transport


class Progressing(Protocol):
    """What ``wait_until`` watches: ``Runtime`` and ``ActorSystem`` both have it."""

    async def wait_progress(self) -> None: ...


async def wait_until(
    runtime: Progressing,
    predicate: Callable[[], bool],
    timeout: float = 10.0,  # noqa: ASYNC109 - its own deadline, so the error names the wait
    *,
    what: str | None = None,
) -> None:
    """Return once ``predicate()`` holds, checking it again each time an actor of ``runtime``
    handles a message or stops (its state changes only then): no polling.

    Raises ``TimeoutError`` naming what was awaited (``what``, else the predicate's source) if it
    does not hold within ``timeout`` seconds; a safety net, not a timing.
    """
    with anyio.move_on_after(timeout):
        while not predicate():
            await runtime.wait_progress()
        return
    awaited = what or _describe(predicate)
    raise TimeoutError(f"waited {timeout} s for a condition that never held: {awaited}")


def _describe(predicate: Callable[[], bool]) -> str:
    name = getattr(predicate, "__qualname__", "")
    if name and "<lambda>" not in name:
        return name
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


def engine_stats(runtime: Runtime, loaded: ModelLoaded) -> Stats:
    """Statistics of the engine that the load answered by ``loaded`` started (its model at its
    epoch). Raises ``LookupError`` once that engine has stopped."""
    address = engine_address(loaded.model, loaded.epoch)
    stats = runtime.stats().actors.get(address)
    if stats is None:
        raise LookupError(f"no engine runs at {address!r} (unloaded, or the runtime closed)")
    return stats
