"""The OpenAI-compatible HTTP server: a Starlette app over one ``Runtime``.

``OpenAIServer(config).app`` is the ASGI app. Its lifespan enters the ``Runtime`` and loads the
configured models (the server accepts requests once they are loaded), and leaves it on shutdown,
which cancels whatever still runs. Routes: ``GET /v1/models``, ``GET /v1/models/{model}``,
``POST /v1/models/load``, ``POST /v1/models/unload``, ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/prewarm`` (the runtime's own), ``GET /health``,
``GET /metrics`` (Prometheus). Model management (what is available, loading on demand) is
``ModelManager`` (models.py). See docs/http.md.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Literal, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from runtime.backends.model_source import available_models
from runtime.errors import MlxRuntimeError, ModelNotLoaded, RuntimeClosed
from runtime.host.api import Runtime
from runtime.messages import Cancelled, Failed, Finished, FinishReason
from runtime.progress import Progress, no_progress
from runtime.server import replies
from runtime.server import schema as wire
from runtime.server.auth import scoped
from runtime.server.bodies import (
    decode_body,
    json_response,
    on_http_error,
    on_route_error,
    read_body,
)
from runtime.server.compat import FieldNotes, default_model
from runtime.server.config import ServerConfig, allowances_of
from runtime.server.cors import cors_middleware
from runtime.server.errors import (
    HttpError,
    error_for_cancelled,
    error_for_failed,
    error_for_runtime,
    model_not_loaded,
)
from runtime.server.gate import KeyGate
from runtime.server.generation import GenerationResponse
from runtime.server.media import MediaSources, fetch_remote, read_local
from runtime.server.metrics import OTHER_MODEL, ServerMetrics
from runtime.server.models import ModelManager
from runtime.server.render import ChatRender, CompletionRender, Render
from runtime.server.shutdown import ShutdownNotice, shutting_down
from runtime.server.tool_render import ChatToolRender
from runtime.server.translate import RuntimeCall, chat_call, completion_call, prewarm_call

log = logging.getLogger("mlx_actor_runtime.server")
_T = TypeVar("_T")
_Generation = TypeVar("_Generation", wire.CompletionRequest, wire.ChatCompletionRequest)
_Named = TypeVar("_Named", wire.CompletionRequest, wire.ChatCompletionRequest, wire.PrewarmRequest)


class OpenAIServer:
    """One ``Runtime`` served over HTTP; ``app`` is the ASGI application to run."""

    def __init__(self, config: ServerConfig, *, progress: Progress = no_progress) -> None:
        """``progress``: where fetching, converting and loading a model on demand report to.
        Raises ``InvalidConfig`` for per-key limits out of range, or keys not in ``ApiKeys``."""
        self.config = config
        self._progress = progress
        self._runtime: Runtime | None = None
        self._manager: ModelManager | None = None
        self._served: set[str] = set()  # models loaded at some point: their metrics labels
        self.allowances = allowances_of(config)  # per-key limits; None: no limits
        self._shutdown: ShutdownNotice | None = None  # made in the lifespan (its event loop)
        self._field_notes = FieldNotes()
        self.metrics = ServerMetrics(
            lambda: None if self._runtime is None else self._runtime.stats()
        )
        self.app = Starlette(
            routes=[
                Route("/v1/models", self._list_models, methods=["GET"]),
                Route("/v1/models/load", self._load_model, methods=["POST"]),
                Route("/v1/models/unload", self._unload_model, methods=["POST"]),
                Route("/v1/models/{model:path}", self._get_model, methods=["GET"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat_completions, methods=["POST"]),
                Route("/v1/prewarm", self._prewarm, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
            lifespan=self._lifespan,
            exception_handlers={HttpError: on_http_error, HTTPException: on_route_error},
            # CORS outside the key gate: a refusal (401, 429) still carries CORS headers, so a
            # browser page sees it, and preflights pass the gate (docs/http.md).
            middleware=[
                *cors_middleware(config.allowed_origins),
                Middleware(
                    KeyGate,
                    keys=config.api_keys,
                    metrics_keys=config.metrics_keys,
                    public_metrics=config.public_metrics,
                    allowances=self.allowances,
                    shutdown=lambda: self._shutdown,
                ),
            ],
        )

    @property
    def runtime(self) -> Runtime:
        """The running ``Runtime``; raises ``RuntimeClosed`` outside the app's lifespan."""
        if self._runtime is None:
            raise RuntimeClosed("the server is not running (before start-up or after shutdown)")
        return self._runtime

    @property
    def models(self) -> ModelManager:
        """The model manager; raises ``RuntimeClosed`` outside the app's lifespan."""
        if self._manager is None:
            raise RuntimeClosed("the server is not running (before start-up or after shutdown)")
        return self._manager

    async def stop_generations(self, within_s: float) -> int:
        """End every open generation properly (shutdown.py) and refuse new ones; wait at most
        ``within_s`` seconds for their endings to be sent. Returns how many were open. Call it
        before the HTTP server closes its connections (``mlxrt serve`` does, on SIGINT/SIGTERM)."""
        if self._shutdown is None:
            return 0
        open_now = self._shutdown.open_generations
        self._shutdown.give()
        if not await self._shutdown.wait_ended(within_s):
            log.warning("%d requests had not ended %.0f s into the shutdown", open_now, within_s)
        return open_now

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        config = self.config
        self._shutdown = ShutdownNotice()
        async with Runtime(config.runtime) as runtime:
            manager = ModelManager(
                runtime,
                config.models,
                keep_alive_s=config.keep_alive_s,
                auto_load=config.runtime.auto_load,
                progress=self._progress,
                loaded=self._declare,
                catalog=available_models if config.offer_cached_models else list,
                catalog_backend=config.catalog_backend,
            )
            for spec in config.models:
                await manager.load_spec(spec)
            self._runtime, self._manager = runtime, manager
            try:
                yield
            finally:
                self._runtime = self._manager = None

    def _declare(self, model: str) -> None:
        self._served.add(model)
        self.metrics.declare_model(model)

    # ------------------------------------------------------------------ routes

    async def _list_models(self, _request: Request) -> Response:
        return json_response(replies.ModelList(data=await self.models.cards()))

    async def _get_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        card = await self.models.card(name)
        if card is None:
            raise model_not_loaded(name)
        return json_response(card)

    async def _load_model(self, request: Request) -> Response:
        """Not cancelled when the client goes away: the load goes on, as a prewarm does."""
        body = decode_body(await self._read_body(request), wire.load_request_decoder)
        try:
            loaded = await self.models.load(body.model, body.keep_alive)
        except MlxRuntimeError as error:
            raise error_for_runtime(error) from error
        status = await self.models.card(body.model)
        result = replies.ModelLoadResult(
            model=loaded.model,
            epoch=loaded.epoch,
            context_length=loaded.context_length,
            reuse_path=loaded.reuse_path,
            keep_alive=None if status is None else status.keep_alive,
        )
        return json_response(result)

    async def _unload_model(self, request: Request) -> Response:
        body = decode_body(await self._read_body(request), wire.unload_request_decoder)
        try:
            unloaded = await self.models.unload(body.model)
        except ModelNotLoaded:
            raise model_not_loaded(body.model) from None
        except MlxRuntimeError as error:
            raise error_for_runtime(error) from error
        return json_response(replies.ModelUnloadResult(model=unloaded.model, epoch=unloaded.epoch))

    async def _health(self, _request: Request) -> Response:
        """``models``: each model the runtime knows and its state (``loading`` while a request
        waits for an on-demand load)."""
        if self._runtime is None:
            raise error_for_runtime(RuntimeClosed("the server is starting or stopping"))
        models = {status.name: status.state for status in await self._runtime.list_models()}
        return json_response({"status": "ok", "models": models})

    async def _metrics(self, _request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=self.metrics.content_type)

    async def _completions(self, request: Request) -> Response:
        body = await self._read_body(request)
        decoded = await self._named(decode_body(body, wire.completion_request_decoder))
        self._field_notes.note(decoded)
        call = _scoped(request, completion_call(self._defaulted(decoded)))
        render = CompletionRender(
            f"cmpl-{uuid.uuid4().hex}",
            call.request.model,
            logprobs=call.request.sampling.logprobs,
            include_usage=call.include_usage,
        )
        return await self._generation(call, render)

    async def _named(self, request: _Named) -> _Named:
        """``request`` naming the server's only model when it names none (compat.py)."""
        if request.model is not None:
            return request
        names = {status.name for status in await self.runtime.list_models()}
        names.update(spec.name for spec in self.config.models)
        return msgspec.structs.replace(request, model=default_model(sorted(names)))

    def _defaulted(self, request: _Generation) -> _Generation:
        """``request`` with the server's default temperature and token limit where it sends
        none (the limit is lowered to the room the prompt leaves, as any max_tokens is)."""
        if request.temperature is None:
            request = msgspec.structs.replace(request, temperature=self.config.default_temperature)
        limit = self.config.default_max_tokens
        sent_limit = request.max_tokens not in (None, msgspec.UNSET) or request.n_predict
        if isinstance(request, wire.ChatCompletionRequest):
            sent_limit = sent_limit or request.max_completion_tokens is not None
        if limit is not None and not sent_limit:
            request = msgspec.structs.replace(request, max_tokens=limit)
        return request

    async def _chat_completions(self, request: Request) -> Response:
        body = await self._read_body(request)
        decoded = await self._named(decode_body(body, wire.chat_request_decoder))
        self._field_notes.note(decoded)
        sources = await self._media_sources(decoded.messages)
        call = _scoped(request, chat_call(self._defaulted(decoded), sources))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        logprobs, include_usage = call.request.sampling.logprobs, call.include_usage
        render: Render
        if call.tools is not None and call.tools.names:
            render = ChatToolRender(
                request_id,
                call.request.model,
                logprobs=logprobs,
                include_usage=include_usage,
                names=call.tools.names,
                parallel=call.tools.parallel,
                end_on_repeat=call.tools.ends_on_repeat,
            )
        else:
            render = ChatRender(
                request_id, call.request.model, logprobs=logprobs, include_usage=include_usage
            )
        return await self._generation(call, render)

    async def _media_sources(self, messages: list[wire.WireChatMessage]) -> MediaSources:
        """Where this request's images may come from: the allowed directories, and its remote
        images, fetched first where the host enabled it (server/media.py)."""
        config = self.config
        fetched = await fetch_remote(messages, config.fetch_images, config.fetch_timeout_s)
        fetched.update(await read_local(messages, config.media_dirs))
        return MediaSources(config.media_dirs, fetched)

    async def _prewarm(self, request: Request) -> Response:
        """Not cancelled when the client goes away: a client may send it and not wait."""
        body = await self._read_body(request)
        named = await self._named(decode_body(body, wire.prewarm_request_decoder))
        sources = await self._media_sources(named.messages or [])
        call = scoped(request, prewarm_call(named, sources))
        try:
            await self.models.ensure_loaded(call.model)
            ended = await self.runtime.submit_prewarm(call)
        except ModelNotLoaded:
            self.metrics.prewarm_ended(self._model_label(call.model), None)
            raise model_not_loaded(call.model) from None
        except MlxRuntimeError as error:
            self.metrics.prewarm_ended(self._model_label(call.model), None)
            raise error_for_runtime(error) from error
        self.metrics.prewarm_ended(self._model_label(call.model), ended)
        match ended:
            case Finished(reason=FinishReason.ADOPTED):
                status: Literal["prewarmed", "adopted", "superseded"] = "adopted"
            case Finished():
                status = "prewarmed"
            case Cancelled(reason="superseded"):
                status = "superseded"
            case Cancelled():
                raise error_for_cancelled(ended)
            case Failed():
                raise error_for_failed(ended, "messages" if call.messages else "prompt")
        usage = ended.usage
        result = replies.PrewarmResult(
            model=call.model,
            status=status,
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_prompt_tokens,
        )
        return json_response(result)

    # ------------------------------------------------------------------ plumbing

    async def _generation(self, call: RuntimeCall, render: Render) -> Response:
        if self._shutdown is not None and self._shutdown.stopping:
            raise shutting_down()
        model = call.request.model
        timer = self.metrics.stream_timer(self._model_label(model))
        try:
            # A model available but not loaded is loaded first (with auto-load): the client
            # waits, streaming or not, and GET /v1/models shows it loading.
            await self.models.ensure_loaded(model)
            stream = self.runtime.submit(call.request, request_id=render.request_id)
        except MlxRuntimeError as error:
            timer.ended("rejected")
            raise error_for_runtime(error) from error
        return GenerationResponse(
            stream, render, streaming=call.stream, timer=timer, shutdown=self._shutdown
        )

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.config.max_body_bytes)

    def _model_label(self, model: str) -> str:
        # Clients name the model: an unknown name must not mint a new time series per request.
        return model if model in self._served else OTHER_MODEL


def _scoped(request: Request, call: RuntimeCall) -> RuntimeCall:
    """``call`` in its key's own cache namespace and sessions (auth.scoped)."""
    return msgspec.structs.replace(call, request=scoped(request, call.request))
