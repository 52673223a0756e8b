"""The loader the engines use: a backend of the kind a ``ModelSpec`` names."""

from __future__ import annotations

from runtime.backends.contract import Backend, BackendLoader
from runtime.backends.options import SimulatedModelOptions, options_type
from runtime.backends.simulated import ComputeClock, RealClock, SimulatedBackend
from runtime.messages import ModelSpec


def make_backend_loader(clock: ComputeClock | None = None) -> BackendLoader:
    """A loader for every backend kind; simulated compute spends time on ``clock``."""
    sim_clock = clock or RealClock()

    def load(spec: ModelSpec) -> Backend:
        if options_type(spec) is SimulatedModelOptions:  # InvalidModelSpec for an unknown kind
            return SimulatedBackend.load(spec, sim_clock)
        from runtime.backends.mlx.backend import MlxBackend

        return MlxBackend.load(spec)

    return load
