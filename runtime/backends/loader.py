"""The loader the engines use: a backend of the kind a ``ModelSpec`` names, given the options the
engine decoded (the backend does not decode them again)."""

from __future__ import annotations

from runtime.backends.contract import Backend, BackendLoader
from runtime.backends.options import (
    LlamaCppOptions,
    ModelOptions,
    SimulatedModelOptions,
    options_type,
    probe_in_background,
)
from runtime.backends.simulated import ComputeClock, RealClock, SimulatedBackend
from runtime.errors import InvalidModelSpec
from runtime.messages import ModelSpec


def make_backend_loader(clock: ComputeClock | None = None) -> BackendLoader:
    """A loader for every backend kind; simulated compute spends time on ``clock``."""
    sim_clock = clock or RealClock()

    def load(spec: ModelSpec, options: ModelOptions) -> Backend:
        """Raises ``InvalidModelSpec`` for an unknown kind, or options of another kind's."""
        kind = options_type(spec)
        if type(options) is not kind:
            raise InvalidModelSpec(
                f"model {spec.name!r} (backend {spec.backend!r}) takes {kind.__name__}, "
                f"not {type(options).__name__}"
            )
        if isinstance(options, SimulatedModelOptions):
            return SimulatedBackend.load(spec, sim_clock, options)
        if isinstance(options, LlamaCppOptions):
            from runtime.backends.llamacpp.backend import LlamaCppBackend

            return LlamaCppBackend.load(spec, options)
        from runtime.backends.mlx.backend import MlxBackend

        # An engine runs a deferred probe while idle; a direct MlxBackend.load has no engine.
        return MlxBackend.load(spec, options, defer_probe=probe_in_background(options))

    return load
