"""One model's record in the router's model table: its state, its status line, its refusals.

``ModelLifecycle`` (model_lifecycle.py) moves a ``Model`` between its states; what a record says
to the outside is here: its ``ModelStatus`` for ``ListModels``, why a request for a model that is
not ready is refused (a code and an actionable sentence), and the one log line each load gets.
The states and their moves: docs/protocols.md, "Teardown fencing (unload / drain)".
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from actors.keep_alive import KeepAlive
from runtime.errors import ModelFailed, ModelNotLoaded, ModelRestarting
from runtime.kernel.core import Address, engine_address
from runtime.kernel.supervision import RestartTracker
from runtime.messages import CommandFailed, ModelLoaded, ModelSpec, ModelStateName, ModelStatus

log = logging.getLogger("mlx_actor_runtime.models")


class ModelState(enum.Enum):
    LOADING = enum.auto()
    READY = enum.auto()
    UNLOADING = enum.auto()
    RESTARTING = enum.auto()
    FAILED = enum.auto()


_STATE_NAMES: dict[ModelState, ModelStateName] = {
    ModelState.LOADING: "loading",
    ModelState.READY: "loaded",
    ModelState.UNLOADING: "unloading",
    ModelState.RESTARTING: "restarting",
    ModelState.FAILED: "failed",
}


@dataclass
class Model:
    """One load of a model and the askers waiting on it."""

    spec: ModelSpec
    epoch: int
    state: ModelState
    restarts: RestartTracker
    loaded: ModelLoaded | None = None
    load_waiter: Address | None = None
    unload_waiters: list[Address] = field(default_factory=list)
    failure: str = ""  # why a FAILED model was taken out of service, said to the host
    idle_unload: bool = False  # UNLOADING because its keep-alive ran out (not asked to)
    since: float = 0.0  # when its current load (or unload) began, for its log line
    placement: str = ""  # where its engine runs, if in a process of its own

    @property
    def address(self) -> Address:
        return engine_address(self.spec.name, self.epoch)


def status_of(model: Model, keep_alive: KeepAlive, now: float) -> ModelStatus:
    """``model``'s line in ``ListModels``."""
    epoch, keep_alive_s = model.epoch, model.spec.keep_alive_s
    return ModelStatus(
        name=model.spec.name,
        state=_STATE_NAMES[model.state],
        epoch=epoch,
        path=model.spec.path,
        live_requests=keep_alive.live(epoch),
        keep_alive_s=keep_alive_s,
        expires_in_s=keep_alive.expires_in(epoch, keep_alive_s, now)
        if model.state is ModelState.READY
        else None,
        context_length=None if model.loaded is None else model.loaded.context_length,
        failure=model.failure,
        placement=model.placement,
        limits={} if model.loaded is None else model.loaded.limits,
    )


def refusal(name: str, model: Model | None) -> tuple[str, str]:
    """Why a request for ``name``, which is not ``ready``, is refused: a code and a sentence."""
    if model is not None and model.state is ModelState.RESTARTING:
        text = f"model {name!r} is restarting after its engine failed; retry shortly"
        return ModelRestarting.code, text
    if model is not None and model.state is ModelState.FAILED:
        return ModelFailed.code, model.failure
    if model is None:
        return ModelNotLoaded.code, not_loaded_text(name)
    if model.state is ModelState.UNLOADING:
        text = f"model {name!r} is being unloaded; load it again once that ends"
    else:
        text = f"model {name!r} is still loading; send the request once load_model returns"
    return ModelNotLoaded.code, text


def log_loaded(
    spec: ModelSpec, loaded: ModelLoaded, seconds: float, *, restarted: bool, pending: bool
) -> None:
    """The one line each load (or reload after its engine failed) gets."""
    keep = spec.keep_alive_s
    log.info(
        "%s %s on %s in %.1f s (context %d tokens, prefix reuse by %s%s, keep-alive %s)",
        "reloaded after its engine failed:" if restarted else "loaded",
        spec.name,
        spec.backend,
        seconds,
        loaded.context_length,
        loaded.reuse_path,
        " until the load probe, running while idle, gives its verdict" if pending else "",
        "forever" if keep is None else f"{keep:g} s",
    )


def not_loaded_text(name: str) -> str:
    return f"model {name!r} is not loaded; call load_model first (or check the name)"


def not_loaded(name: str) -> CommandFailed:
    return CommandFailed(code=ModelNotLoaded.code, message=not_loaded_text(name))
