"""The server's models: what it can serve, loading one on demand, and the list it shows.

A model is *available* when the server has a spec for it: one it was started with (``--model``,
or the default model), a known model (fetched from PyPI on first use), or a GGUF conversion in the
cache. The runtime itself keeps the models it loaded, their keep-alive and their idle reload
(``ModelSpec.keep_alive_s``, ``RuntimeConfig.auto_load``); this module adds what needs the
filesystem or the network first: fetching and converting (in a worker thread, one load per name
at a time, shown as ``preparing``), then ``Runtime.load_model``.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import math
import re
import time
from collections.abc import Callable

import anyio
import msgspec

from actors.replicas import replica_base
from runtime.backends.choice import resolve_backend
from runtime.backends.model_source import (
    AvailableModel,
    available_models,
    prepare_model,
    prepared_spec,
)
from runtime.errors import (
    ModelAlreadyLoaded,
    ModelLoading,
    ModelNotAvailable,
    ModelUnloading,
)
from runtime.host.api import Runtime
from runtime.kernel.core import engine_address
from runtime.messages import ModelLoaded, ModelSpec, ModelStatus, ModelUnloaded
from runtime.progress import Progress, no_progress
from runtime.server import replies as wire
from runtime.server.errors import invalid

log = logging.getLogger("mlx_actor_runtime.server")

_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
# A model's card shows the first of its replicas' states in this order.
_REPLICAS_STATE_ORDER: tuple[wire.ModelCardState, ...] = (
    "loaded", "loading", "restarting", "unloading", "idle", "failed",
)  # fmt: skip


class _Unset(enum.Enum):
    KEEP = enum.auto()  # no keep-alive given: the spec's own, or the server's default


KEEP = _Unset.KEEP


def parse_keep_alive(value: float | str) -> float | None:
    """A keep-alive as given on the wire or the command line (seconds, or "30s", "5m", "1h";
    negative: forever) in seconds, None for forever. Raises ``ValueError`` with a sentence."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(
                f"keep_alive {value!r} is not a duration; give seconds (300), a duration "
                '("30s", "5m", "1h") or -1 to keep the model loaded'
            )
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise ValueError("keep_alive must be a finite number of seconds (-1: keep it loaded)")
    return None if seconds < 0 else seconds


class ModelManager:
    """Loads, unloads and lists the models of one server's ``Runtime`` (see module docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        configured: tuple[ModelSpec, ...],
        *,
        keep_alive_s: float | None,
        auto_load: bool,
        progress: Progress = no_progress,
        loaded: Callable[[str], None] = lambda name: None,
        catalog: Callable[[], list[AvailableModel]] = available_models,
        catalog_backend: str = "mlx",
    ) -> None:
        """``keep_alive_s``: of models loaded by name (not configured ones, whose spec says);
        ``loaded``: called with each model's name once it is in; ``catalog``: the loadable
        models beyond the configured ones, loaded on ``catalog_backend``."""
        self._runtime = runtime
        self._configured = {spec.name: spec for spec in configured}
        self._keep_alive_s = keep_alive_s
        self._auto_load = auto_load
        self._progress = progress
        self._loaded = loaded
        self._catalog = catalog
        self._catalog_backend = catalog_backend
        self._preparing: dict[str, anyio.Event] = {}
        self._prepared: dict[str, ModelSpec] = {}  # loaded by name (not configured), prepared
        self._first_seen: dict[str, int] = {}
        # Loaded here and not unloaded here: the runtime keeps these (loading, idle, failed...),
        # so a request for one needs no look at the model table first.
        self._in_runtime: set[str] = set()

    # ------------------------------------------------------------------ loading

    async def ensure_loaded(self, name: str) -> None:
        """Before a request for ``name``: with auto-load, a model the runtime does not know but
        this server can load is loaded first (fetched and converted as needed). Anything else
        (loaded, loading, idle, failed, unknown) is left to the runtime, which admits, waits,
        reloads or refuses the request. Raises ``MlxRuntimeError`` when the load fails."""
        if not self._auto_load or name in self._in_runtime:
            return
        if any(status.name == name for status in await self._runtime.list_models()):
            return
        preparing = self._preparing.get(name)  # looked up after the await: no load starts twice
        if preparing is not None:
            await preparing.wait()
            return
        spec = self.spec_for(name)
        if spec is not None:
            with contextlib.suppress(ModelAlreadyLoaded, ModelLoading):
                await self.load_spec(spec)  # another request loaded it meanwhile: as good

    async def load(self, name: str, keep_alive: float | str | None = None) -> ModelLoaded:
        """``POST /v1/models/load``. Raises ``ModelAlreadyLoaded``, ``ModelLoading``,
        ``ModelUnloading``, ``ModelNotAvailable`` or the load's own failure."""
        if name in self._preparing:
            raise ModelLoading(f"model {name!r} is being prepared (fetched or converted) to load")
        status = await self._status(name)
        if status is not None and status.state in ("loaded", "restarting"):
            raise ModelAlreadyLoaded(
                f"model {name!r} is already loaded; unload it first to load it with new settings"
            )
        if status is not None and status.state == "loading":
            raise ModelLoading(f"model {name!r} is loading; GET /v1/models shows when it is in")
        if status is not None and status.state == "unloading":
            raise ModelUnloading(f"model {name!r} is being unloaded; load it once that ends")
        try:
            override = KEEP if keep_alive is None else parse_keep_alive(keep_alive)
        except ValueError as error:
            raise invalid("keep_alive", str(error)) from None
        spec = self.spec_for(name, override)
        if spec is None:
            raise ModelNotAvailable(
                f"model {name!r} is not one this server can load; GET /v1/models lists the "
                "loaded and available ones (configured, known and converted models)"
            )
        return await self.load_spec(spec)

    async def load_spec(self, spec: ModelSpec) -> ModelLoaded:
        """Fetch and convert ``spec``'s model as needed (in a worker thread), then load it."""
        name = spec.name
        if name in self._preparing:  # checked and marked with no await between
            raise ModelLoading(f"model {name!r} is being prepared (fetched or converted) to load")
        done = self._preparing[name] = anyio.Event()
        try:
            if spec.backend == "mlx":
                prepared = await anyio.to_thread.run_sync(prepare_model, spec, self._progress)
                if prepared.note:
                    log.info("%s: %s", name, prepared.note)
                spec = prepared_spec(spec, prepared)
                if name not in self._configured:  # a load on demand later needs no new fetch
                    self._prepared[name] = spec
            stage = f"load {name}"
            self._progress(stage, 0, 1)
            loaded = await self._runtime.load_model(spec)
            self._progress(stage, 1, 1)
        finally:
            del self._preparing[name]
            done.set()
        self._in_runtime.add(name)  # the runtime logged the load (actors/model_lifecycle.py)
        self._loaded(name)
        return loaded

    async def unload(self, name: str) -> ModelUnloaded:
        """``POST /v1/models/unload``: drain the model and free its memory. Raises
        ``ModelLoading`` while it is being prepared, ``ModelNotLoaded`` if it is not loaded."""
        if name in self._preparing and await self._status(name) is None:
            raise ModelLoading(f"model {name!r} is being prepared; unload it once it is loaded")
        try:
            return await self._runtime.unload_model(name)
        finally:  # the runtime forgets it (even an idle one it refuses): load it anew on demand
            self._in_runtime.discard(name)

    def spec_for(self, name: str, keep_alive: float | _Unset | None = KEEP) -> ModelSpec | None:
        """The spec to load ``name`` with (None: not available); ``keep_alive`` (seconds or None)
        replaces its keep-alive."""
        spec = self._configured.get(name) or self._prepared.get(name)
        if spec is None:
            entry = next((m for m in self._catalog() if m.name == name), None)
            if entry is None:
                return None
            spec = resolve_backend(
                ModelSpec(
                    name=name,
                    path=entry.path,
                    backend=self._catalog_backend,
                    keep_alive_s=self._keep_alive_s,
                )
            )
        if not isinstance(keep_alive, _Unset):
            spec = msgspec.structs.replace(spec, keep_alive_s=keep_alive)
        return spec

    # ------------------------------------------------------------------ listing

    async def cards(self) -> list[wire.ModelCard]:
        """Every model the runtime knows (its state), then those being prepared, then the
        available ones not loaded (``GET /v1/models``)."""
        now = time.time()
        cards = self._one_per_name(
            [self._card_of(status, now) for status in await self._runtime.list_models()]
        )
        seen = {card.id for card in cards}
        for name in self._preparing:
            if name not in seen:
                cards.append(
                    wire.ModelCard(
                        id=name, created=self._created(name), state="preparing",
                        source=self._source(name),
                    )
                )  # fmt: skip
                seen.add(name)
        for name, spec in self._configured.items():
            if name not in seen:
                cards.append(
                    wire.ModelCard(
                        id=name, created=self._created(name), state="available",
                        source="configured", keep_alive=spec.keep_alive_s,
                    )
                )  # fmt: skip
                seen.add(name)
        for entry in self._catalog():
            if entry.name not in seen:
                cards.append(
                    wire.ModelCard(
                        id=entry.name, created=self._created(entry.name), state="available",
                        source=entry.source, keep_alive=self._keep_alive_s, cache=entry.cache,
                        description=entry.description,
                    )
                )  # fmt: skip
        return cards

    async def card(self, name: str) -> wire.ModelCard | None:
        """One model's card (``GET /v1/models/{model}``; a replica's too, ``NAME@i``), None if
        the server has no such model."""
        cards = await self.cards()
        everyone = [*cards, *(r for card in cards for r in card.replicas or ())]
        return next((card for card in everyone if card.id == name), None)

    def _one_per_name(self, cards: list[wire.ModelCard]) -> list[wire.ModelCard]:
        """The replicas of a model as one card for its name (an OpenAI client sees one model),
        each replica's card inside it; other cards as they are, in order."""
        out: list[wire.ModelCard] = []
        groups: dict[str, list[wire.ModelCard]] = {}
        for card in cards:
            base = replica_base(card.id)
            if base is None:
                out.append(card)
            elif base not in groups:
                groups[base] = [card]
                out.append(card)  # replaced below by the name's card, at the first one's place
            else:
                groups[base].append(card)
        for base, replicas in groups.items():
            out[out.index(replicas[0])] = self._name_card(base, replicas)
        return out

    def _name_card(self, name: str, replicas: list[wire.ModelCard]) -> wire.ModelCard:
        states = {card.state for card in replicas}
        # The name serves while any replica does; else the most hopeful of their states.
        state = next(s for s in _REPLICAS_STATE_ORDER if s in states)
        first = replicas[0]
        return wire.ModelCard(
            id=name,
            created=self._created(name),
            state=state,
            source=self._source(name),
            context_length=next((c.context_length for c in replicas if c.context_length), None),
            keep_alive=first.keep_alive,
            expires_at=first.expires_at,
            live_requests=sum(card.live_requests for card in replicas),
            failure=first.failure if state == "failed" else None,
            limits=first.limits,
            replicas=replicas,
        )

    async def _status(self, name: str) -> ModelStatus | None:
        return next((s for s in await self._runtime.list_models() if s.name == name), None)

    def _source(self, name: str) -> wire.ModelSource:
        if name in self._configured:
            return "configured"
        entry = next((m for m in self._catalog() if m.name == name), None)
        return "loaded" if entry is None else entry.source

    def _card_of(self, status: ModelStatus, now: float) -> wire.ModelCard:
        expires_at = None if status.expires_in_s is None else int(now + status.expires_in_s)
        return wire.ModelCard(
            id=status.name,
            created=self._created(status.name),
            state=status.state,
            source=self._source(status.name),
            context_length=status.context_length,
            keep_alive=status.keep_alive_s,
            expires_at=expires_at,
            live_requests=status.live_requests,
            failure=status.failure or None,
            limits=status.limits or None,
            placement=status.placement or None,
            disk_cache=self._disk_cache(status),
        )

    def _disk_cache(self, status: ModelStatus) -> dict[str, int] | None:
        stats = self._runtime.stats().actors.get(engine_address(status.name, status.epoch))
        if stats is None or "disk_entries" not in stats.gauges:
            return None
        return {
            "entries": stats.gauges["disk_entries"],
            "bytes": stats.gauges["disk_bytes"],
            "hits": stats.counters.get("disk_hits", 0),
            "load_ms": stats.counters.get("disk_load_ms", 0),
        }

    def _created(self, name: str) -> int:
        # OpenAI's ``created``: here, when this server first listed the model.
        return self._first_seen.setdefault(name, int(time.time()))
