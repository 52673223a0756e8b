"""Every error the runtime raises or reports, each with a stable ``code``.

Errors raised to the host derive from ``MlxRuntimeError``. Input errors also derive from
``ValueError``. Failures of accepted requests travel as ``Failed`` events carrying the same codes,
so a host can map either form to one handler. Codes never change meaning once published.
"""

from __future__ import annotations

from typing import ClassVar


class MlxRuntimeError(Exception):
    """Base of the runtime's errors. ``code`` is stable; ``retryable`` says whether to try again."""

    code: ClassVar[str] = "runtime_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


# --------------------------------------------------------------------------- bad input


class InvalidRequest(MlxRuntimeError, ValueError):
    """Raised before any work starts when a request's fields are malformed or out of range."""

    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    """Reported when prompt plus ``max_tokens`` does not fit the model's context window."""

    code = "context_length_exceeded"


class MalformedMessage(InvalidRequest):
    """Raised by ``runtime.messages.decode`` when bytes are not the wire form of a message:
    not msgpack, an unknown ``type`` tag, a missing, unknown or wrongly typed field."""

    code = "malformed_message"


class InvalidModelSpec(InvalidRequest):
    """Raised when a ``ModelSpec`` names an unknown backend or has malformed options."""

    code = "invalid_model_spec"


class DraftModelIncompatible(InvalidModelSpec):
    """Raised at load when a model's ``draft_model`` cannot draft for it: a different vocabulary
    size, token ids, end-of-sequence or begin-of-sequence tokens, a backend with no verification
    pass, or a draft whose caches cannot be cut back (the message names the difference)."""

    code = "draft_model_incompatible"


class InvalidConfig(InvalidRequest):
    """Raised when a ``RuntimeConfig`` knob is out of its range (the message names it)."""

    code = "invalid_config"


class InvalidSchema(InvalidRequest):
    """Raised before any work when a ``JsonSchemaConstraint`` (``response_format`` json_schema) is
    not JSON, not a schema, or uses what the grammar engine cannot enforce (with ``strict``)."""

    code = "invalid_schema"


class InvalidGrammar(InvalidRequest):
    """Raised before any work when a ``RegexConstraint`` or ``GrammarConstraint`` does not parse
    or cannot be enforced; the message quotes the grammar engine's own words."""

    code = "invalid_grammar"


class ConstraintsUnsupported(InvalidRequest):
    """Reported when a request has a ``constraint`` and its model's backend has no grammar engine
    (the simulated backend)."""

    code = "constraints_unsupported"


class InvalidMedia(InvalidRequest):
    """Reported (before any KV is reserved) when an image of a chat message cannot be used: its
    bytes are not an image, its format is not one the runtime decodes, or it is larger than the
    limits allow. The message names the message and image (``messages[1].images[0]``)."""

    code = "invalid_media"


class TooManyImages(InvalidRequest):
    """Reported when a request carries more images than the model's engine accepts
    (``MediaLimits.max_images``)."""

    code = "too_many_images"


class TooManyFrames(InvalidRequest):
    """Reported when a video brings more frames than the model's engine takes from one video
    (``MediaLimits.max_video_frames``): frames sent directly past the cap (a video file is
    sampled down to it instead)."""

    code = "too_many_frames"


class MediaUnsupported(InvalidRequest):
    """Reported when a request carries images and its model is text-only (no vision tower), or
    its backend cannot take media (llama.cpp, simulated), or a video and its model's family takes
    no video."""

    code = "media_unsupported"


class MediaSourceRefused(InvalidRequest):
    """Raised by the HTTP server when an ``image_url`` names a source it may not read: a local
    file outside the allow-list (``--media-dir``), or a remote URL while fetching is off."""

    code = "media_source_refused"


class MediaEvicted(MlxRuntimeError):
    """Reported when an image a prompt named was dropped from the engine's media store between
    tokenizing and prefilling (more images in flight than the store holds); retry."""

    code = "media_evicted"
    retryable = True


class ConstraintDeadEnd(MlxRuntimeError):
    """Reported when a constrained sequence reaches a state its grammar allows no token from (an
    engine limit, e.g. lexer fuel, was hit): the request fails instead of emitting invalid text."""

    code = "constraint_dead_end"


# --------------------------------------------------------------------------- routing


class ModelNotLoaded(MlxRuntimeError):
    """Raised when a request or command names a model that is not loaded (or is unloading)."""

    code = "model_not_loaded"


class ModelAlreadyLoaded(MlxRuntimeError):
    """Raised when ``load_model`` names a model that is loaded (or unloading)."""

    code = "model_already_loaded"


class ModelLoading(MlxRuntimeError):
    """Raised by ``load_model`` for a model whose load is still under way: wait for it."""

    code = "model_loading"


class ModelNotAvailable(MlxRuntimeError):
    """Raised (by the server) for a model name that is neither loaded nor one it can load: not a
    configured, cached or known model."""

    code = "model_not_available"


class DuplicateRequestId(MlxRuntimeError):
    """Raised when a request id is reused while the earlier request with that id is still live."""

    code = "duplicate_request_id"


class ModelLoadFailed(MlxRuntimeError):
    """Raised when a model's files cannot be found or loaded (the message says what is missing)."""

    code = "model_load_failed"


class ModelFetchFailed(ModelLoadFailed):
    """Raised when a known model's file cannot be fetched from its package index, or the file
    fetched does not match its pinned checksum (the message says which, and what to do)."""

    code = "model_fetch_failed"
    retryable = True


class UnsupportedModelFormat(ModelLoadFailed):
    """Raised when a model file uses an architecture or tensor type the importer cannot convert
    (the message names it and lists what is supported)."""

    code = "unsupported_model_format"


class UnsupportedCache(ModelLoadFailed):
    """Raised when a model loads but keeps a layer's cache in an mlx-lm cache class the MLX
    backend has no adapter for (``runtime.backends.mlx.cache_kinds``): the message names the class
    and the architecture. Raised at load, so no request ever meets it."""

    code = "unsupported_cache"


# --------------------------------------------------------------------------- resources


class KVBudgetExhausted(MlxRuntimeError):
    """Reported when a KV reservation waited its whole deadline without fitting. Try again later."""

    code = "kv_budget_exhausted"
    retryable = True


class KVRequestTooLarge(MlxRuntimeError):
    """Reported when one request needs more KV bytes than the whole budget; it can never fit."""

    code = "kv_request_too_large"


# --------------------------------------------------------------------------- access


class InvalidApiKey(MlxRuntimeError):
    """Raised (by the server) for a request without a valid API key, missing or wrong alike: the
    answer says nothing about which, nor about the keys the server holds."""

    code = "invalid_api_key"


class RateLimited(MlxRuntimeError):
    """Raised (by the server) when a key already has its most requests running and waiting; try
    again when one of them ends."""

    code = "rate_limit_exceeded"
    retryable = True


# --------------------------------------------------------------------------- execution


class BackendError(MlxRuntimeError):
    """Reported when the model backend raised during a prefill or decode step of a sequence."""

    code = "backend_error"
    retryable = True


class EngineCrashed(MlxRuntimeError):
    """Reported for in-flight requests of an engine whose actor crashed and was restarted."""

    code = "engine_crashed"
    retryable = True


class StepTimedOut(EngineCrashed):
    """Reported for in-flight requests of an engine whose compute step ran longer than
    ``RuntimeConfig.step_timeout_s``: the engine was treated as crashed and restarted."""

    code = "step_timeout"


class EngineProcessLost(EngineCrashed):
    """Reported for in-flight requests of an engine running in a process of its own (a Ray
    actor) when that process died (killed, out of memory, a crash in native code): the host
    lives on and the engine is restarted in a new process."""

    code = "engine_process_lost"


class ClusterUnavailable(MlxRuntimeError):
    """Raised at start when the Ray cluster the config names cannot be reached, or Ray (the
    ``[cluster]`` extra) is not installed."""

    code = "cluster_unavailable"


class ClusterResourcesMissing(MlxRuntimeError):
    """Raised when a model's replicas need more of a resource (CPUs, GPUs, a custom one) than the
    Ray cluster has free; the message names the resource, what is asked and what is free."""

    code = "cluster_resources_missing"


class ModelRestarting(MlxRuntimeError):
    """Reported when a request names a model whose engine crashed and is being reloaded."""

    code = "model_restarting"
    retryable = True


class ModelFailed(MlxRuntimeError):
    """Reported when a request names a model taken out of service: its engine crashed more often
    than ``RuntimeConfig.engine_restart`` allows, or could not be reloaded after a crash."""

    code = "model_failed"


class ModelUnloading(MlxRuntimeError):
    """Reported for requests drained because their model is being unloaded."""

    code = "model_unloading"
    retryable = True


class RequestTimedOut(MlxRuntimeError):
    """Reported when a request's ``timeout_s`` passed before it ended, in whatever phase it was.

    Retryable: a timeout says the runtime was busy or the request was big, not that it was wrong;
    whatever prefill it had done is kept as a prefix entry where an abort keeps it, so a retry
    starts from there.
    """

    code = "request_timeout"
    retryable = True


class StreamStalled(MlxRuntimeError):
    """Reported when a generate produced no token for its stall timeout after its first token
    (``stall_timeout_s``). Retryable: a stuck or overloaded engine is not the request's fault."""

    code = "stream_stalled"
    retryable = True


# --------------------------------------------------------------------------- kernel


class ActorStopped(MlxRuntimeError):
    """Raised when asking (or telling) an actor whose mailbox is closed, or that stopped mid-ask."""

    code = "actor_stopped"


class RuntimeClosed(MlxRuntimeError):
    """Raised when the host uses a ``Runtime`` outside its ``async with`` block."""

    code = "runtime_closed"


class AddressInUse(MlxRuntimeError):
    """Raised by ``mlxrt serve`` before it loads any model when its ``--host``/``--port`` cannot
    be listened on: another process holds the port, or the host is no address of this machine."""

    code = "address_in_use"


class ServerShuttingDown(MlxRuntimeError):
    """The HTTP server is stopping (SIGINT, SIGTERM): a request still running, or arriving, is
    ended with this (a 503, or a stream's last chunk) instead of being cut off."""

    code = "server_shutting_down"
    retryable = True


class SupervisionEscalated(MlxRuntimeError):
    """Raised by a supervisor when a child crashed more often than its restart intensity allows."""

    code = "supervision_escalated"


ERRORS_BY_CODE: dict[str, type[MlxRuntimeError]] = {
    cls.code: cls
    for cls in (
        MlxRuntimeError,
        InvalidRequest,
        ContextLengthExceeded,
        MalformedMessage,
        InvalidModelSpec,
        DraftModelIncompatible,
        ModelNotLoaded,
        ModelAlreadyLoaded,
        ModelLoading,
        ModelNotAvailable,
        DuplicateRequestId,
        ModelLoadFailed,
        UnsupportedCache,
        KVBudgetExhausted,
        KVRequestTooLarge,
        InvalidApiKey,
        RateLimited,
        BackendError,
        EngineCrashed,
        StepTimedOut,
        EngineProcessLost,
        ClusterUnavailable,
        ClusterResourcesMissing,
        ModelRestarting,
        ModelFailed,
        ModelUnloading,
        RequestTimedOut,
        StreamStalled,
        ActorStopped,
        RuntimeClosed,
        SupervisionEscalated,
        InvalidMedia,
        TooManyImages,
        TooManyFrames,
        MediaUnsupported,
        MediaSourceRefused,
        MediaEvicted,
    )
}


def error_for_code(code: str, message: str) -> MlxRuntimeError:
    """Build the typed error for a code carried in a ``Failed``/``Rejected``/``CommandFailed``."""
    return ERRORS_BY_CODE.get(code, MlxRuntimeError)(message)
