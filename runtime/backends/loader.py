"""Backend kinds a ``ModelSpec`` can name, and the loader the engines use."""

from __future__ import annotations

from runtime.backends.contract import Backend, BackendLoader
from runtime.backends.simulated import ComputeClock, RealClock, SimulatedBackend
from runtime.errors import InvalidModelSpec
from runtime.messages import ModelSpec

BACKEND_KINDS = ("mlx", "simulated")


def make_backend_loader(clock: ComputeClock | None = None) -> BackendLoader:
    """A loader for every backend kind; simulated compute spends time on ``clock``."""
    sim_clock = clock or RealClock()

    def load(spec: ModelSpec) -> Backend:
        if spec.backend == "simulated":
            return SimulatedBackend.load(spec, sim_clock)
        if spec.backend == "mlx":
            from runtime.backends.mlx.backend import MlxBackend

            return MlxBackend.load(spec)
        raise InvalidModelSpec(
            f"unknown backend {spec.backend!r} for model {spec.name!r}; use one of {BACKEND_KINDS}"
        )

    return load
